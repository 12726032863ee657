"""Run by tests/test_kernels.py in a fresh process: the Triton kernels on CPU tensors through Triton's interpreter,
against the same dense references as the other backends (dtypes, ragged shapes, k = 1..64, neuron subsets, strides)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import torch  # noqa: E402
from test_kernels import Case, assert_matches, check_accumulation, check_all  # noqa: E402

from peft_neuroada.kernels import triton_ops  # noqa: E402

CASES = [
    Case(1, 7, 5, 1),
    Case(37, 50, 70, 5, subset=True, index=torch.int32),
    Case(45, 70, 33, 64, subset=True, dtype=torch.bfloat16),
    Case(70, 40, 9, 20, dtype=torch.float16, index=torch.int32),
    Case(33, 16, 130, 2),
]


def main() -> None:
    for case in CASES:
        check_all(case, "triton")
    case = Case(40, 30, 20, 3, subset=True)
    x_t = case.x.T.contiguous().T
    assert_matches(triton_ops.sampled_grad(x_t, case.grad, case.cols, case.rows), case.sampled_grad(), torch.float32)
    assert_matches(triton_ops.bypass_forward(x_t, case.cols, case.rows, case.delta, 20), case.forward(), torch.float32)
    check_accumulation(Case(40, 30, 24, 5, subset=True, dtype=torch.bfloat16), "triton")
    check_accumulation(Case(20, 10, 12, 1), "triton")
    print(f"checked {len(CASES) + 3} cases")


if __name__ == "__main__":
    main()
