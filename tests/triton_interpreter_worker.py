"""Run by tests/test_kernels.py in a fresh process: the Triton kernels on CPU tensors through Triton's interpreter,
against the same dense references as the other backends (dtypes, ragged shapes, k = 1..64, neuron subsets, strides)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import torch  # noqa: E402
from test_kernels import Case, check_accumulation, check_all  # noqa: E402

CASES = [
    Case(1, 7, 5, 1),
    Case(37, 50, 70, 5, subset=True, index=torch.int32),
    Case(45, 70, 33, 64, subset=True, dtype=torch.bfloat16),
    Case(70, 40, 9, 20, dtype=torch.float16, index=torch.int32),
    Case(33, 16, 130, 2, index=torch.int16),
]


def main() -> None:
    for case in CASES:
        check_all(case, "triton")
    strided = Case(40, 30, 20, 3, subset=True)
    strided.x = strided.x.T.contiguous().T
    strided.grad = strided.grad.T.contiguous().T
    check_all(strided, "triton")
    check_accumulation(Case(40, 30, 24, 5, subset=True, dtype=torch.bfloat16), "triton")
    check_accumulation(Case(20, 10, 12, 1), "triton")
    print(f"checked {len(CASES) + 3} cases")


if __name__ == "__main__":
    main()
