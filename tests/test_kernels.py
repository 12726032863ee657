"""The three sparse products agree with the dense math on every backend, for every input the layers can hand them.

Each backend is compared with a float64 dense reference: the weight gradient `grad.T @ x` gathered at the placement,
and `x @ D.T` / `grad @ D` for the dense scatter D of the deltas (duplicated positions summed). The Triton kernels
run on CPU tensors through Triton's interpreter (tests/triton_interpreter_worker.py), and with the torch ops on the GPU
where there is one."""

from __future__ import annotations

import importlib.util
import itertools
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from peft_neuroada.accel import kernels
from peft_neuroada.accel.kernels import cpu

CPU_BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not cpu.available(), reason="no C compiler"))]
ON_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs a CUDA GPU and triton"
)
# Every backend on the device it computes on: the C kernels and torch ops here; Triton and torch ops on a GPU.
BACKENDS_ON_DEVICES = [
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param("cpu", "cpu", id="c-kernels", marks=pytest.mark.skipif(not cpu.available(), reason="no C compiler")),
    pytest.param("triton", "cuda", id="triton-cuda", marks=ON_GPU),
    pytest.param("torch", "cuda", id="torch-cuda", marks=ON_GPU),
]


class Case:
    """Random inputs for one layer: (T, d_in) x, (T, d_out) grad, n neurons with k distinct columns each (neurons
    share columns)."""

    def __init__(
        self, tokens, d_in, d_out, k, *, subset=False, dtype=torch.float32, index=torch.int64, seed=0, device="cpu"
    ):
        generator = torch.Generator().manual_seed(seed)
        self.d_in, self.d_out, self.device = d_in, d_out, torch.device(device)
        self.x = torch.randn(tokens, d_in, generator=generator).to(device, dtype)
        self.grad = torch.randn(tokens, d_out, generator=generator).to(device, dtype)
        n = d_out // 2 if subset else d_out
        self.rows = torch.randperm(d_out, generator=generator)[:n].to(device, index) if subset else None
        self.cols = torch.rand(n, d_in, generator=generator).argsort(1)[:, :k].to(device, index)
        self.delta = torch.randn(n, k, generator=generator).to(device, dtype)

    @property
    def neurons(self) -> torch.Tensor:
        return torch.arange(self.d_out) if self.rows is None else self.rows.cpu().long()

    def dense_delta(self) -> torch.Tensor:
        dense = torch.zeros(self.d_out, self.d_in, dtype=torch.float64)
        positions = (self.neurons[:, None].expand_as(self.cols), self.cols.cpu().long())
        return dense.index_put_(positions, self.delta.cpu().double(), accumulate=True)

    def sampled_grad(self) -> torch.Tensor:
        return (self.grad.cpu().double().T @ self.x.cpu().double())[self.neurons[:, None], self.cols.cpu().long()]

    def forward(self) -> torch.Tensor:
        return self.x.cpu().double() @ self.dense_delta().T

    def input_grad(self) -> torch.Tensor:
        return self.grad.cpu().double() @ self.dense_delta()


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 accumulation everywhere; one final rounding to a half-precision output. References are on the CPU."""
    scale = expected.abs().max().item() + 1.0
    rtol = 1e-5 if got.dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    got = got.cpu().double()
    torch.testing.assert_close(got, expected, rtol=rtol, atol=4e-6 * scale if rtol == 1e-5 else rtol * scale)


# Small and ragged layers, a training-sized one (SmolLM2's up_proj at 4096 tokens) and a wide one with k = 64.
SHAPES = [(1, 7, 5, 1), (37, 50, 70, 5), (130, 33, 17, 20), (70, 72, 40, 64)]
SHAPES += [(4096, 576, 1536, 20), (333, 1000, 77, 64)]


def check_all(case: Case, backend: str) -> None:
    dtype = case.x.dtype
    got = kernels.sampled_grad(case.x, case.grad, case.cols, case.rows, backend=backend)
    assert got.dtype == torch.float32 and got.shape == case.cols.shape
    assert_matches(got, case.sampled_grad(), torch.float32)
    got = kernels.bypass_forward(case.x, case.cols, case.rows, case.delta, case.d_out, backend=backend)
    assert got.dtype == dtype and got.shape == (case.x.shape[0], case.d_out)
    assert_matches(got, case.forward(), dtype)
    got = kernels.bypass_input_grad(case.grad, case.cols, case.rows, case.delta, case.d_in, dtype, backend=backend)
    assert got.dtype == dtype and got.shape == case.x.shape
    assert_matches(got, case.input_grad(), dtype)


@pytest.mark.parametrize("backend, device", BACKENDS_ON_DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-{}to{}-k{}".format(*s))
@pytest.mark.parametrize("subset", [False, True], ids=["all-neurons", "subset"])
@pytest.mark.parametrize("index", [torch.int16, torch.int32, torch.int64], ids=["int16", "int32", "int64"])
def test_products_match_dense_reference(backend, device, shape, subset, index):
    check_all(Case(*shape, subset=subset, index=index, device=device), backend)


@pytest.mark.parametrize("backend, device", BACKENDS_ON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 20, 64])
def test_half_precision_inputs_accumulate_in_float32(backend, device, dtype, k):
    check_all(Case(515, 200, 130, k, subset=k == 20, dtype=dtype, device=device), backend)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("layout", sorted(cpu.SAMPLED_GRAD_LAYOUTS))
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize(
    "tokens, d_in, d_out, subset, dtype",
    [
        (515, 200, 96, False, torch.float32),  # whole vectors of neurons: gradient rows read in place
        (37, 50, 70, False, torch.float32),  # a ragged last vector of neurons
        (130, 33, 40, True, torch.float32),  # a subset of neurons
        (77, 60, 33, True, torch.bfloat16),  # rows converted to float32 first
        (5, 20, 48, False, torch.float16),  # fewer tokens than a block
    ],
)
def test_both_layouts_of_the_c_delta_gradient_match_the_dense_reference(layout, k, tokens, d_in, d_out, subset, dtype):
    """Whichever layout this machine's library picks for a k, the other one is checked too, also on a transposed x
    and a gradient with feature stride 2."""
    case = Case(tokens, d_in, d_out, k, subset=subset, dtype=dtype)
    strided_grad = torch.zeros(tokens, 2 * d_out, dtype=dtype)[:, ::2].copy_(case.grad)
    for x, grad in ((case.x, case.grad), (case.x.T.contiguous().T, strided_grad)):
        got = cpu.sampled_grad(x, grad, case.cols, case.rows, layout=layout)
        assert_matches(got, case.sampled_grad(), torch.float32)


def test_the_forward_and_the_delta_gradient_gather_straight_from_token_rows_only_at_k1_in_float32():
    """One fixed rule, the same on every machine (the two layouts round differently): the gather layouts convert
    half-precision rows element by element, 2-4x slower there than the transposed ones."""
    assert cpu.layout_for(1) == "gather"
    assert cpu.layout_for(1, (torch.bfloat16, torch.float32)) == "dot"
    assert cpu.layout_for(1, (torch.bfloat16, torch.bfloat16)) == "dot"
    assert cpu.layout_for(1, (torch.float32, torch.float16)) == "dot"
    assert cpu.layout_for(2) == "dot"


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_the_gather_layout_of_the_c_delta_gradient_refuses_more_columns_than_its_registers_hold():
    case = Case(20, 30, 16, 9)
    with pytest.raises(RuntimeError, match="invalid sizes"):
        cpu.sampled_grad(case.x, case.grad, case.cols, None, layout="gather")


@pytest.mark.parametrize("backend, device", BACKENDS_ON_DEVICES)
def test_strided_inputs_are_read_in_place(backend, device):
    """Transposed views (feature-major) and column slices (feature stride 2) give the same products."""
    case = Case(75, 40, 24, 6, subset=True, device=device)
    case.x = case.x.T.contiguous().T
    case.grad = torch.zeros(case.grad.shape[0], 2 * case.grad.shape[1], device=device)[:, ::2].copy_(case.grad)
    assert not case.x.is_contiguous() and not case.grad.is_contiguous()
    check_all(case, backend)


def check_accumulation(case: Case, backend: str) -> None:
    """`out=` adds the product into the caller's tensor (rows of unit stride, or any other strides)."""
    dtype = case.x.dtype
    for make in (lambda t: t.to(case.device, copy=True), lambda t: t.T.contiguous().T.to(case.device)):
        base = torch.randn(case.x.shape[0], case.d_out).to(dtype)
        out = make(base)
        got = kernels.bypass_forward(case.x, case.cols, case.rows, case.delta, case.d_out, out=out, backend=backend)
        assert got is out
        assert_matches(out, base.double() + case.forward(), dtype)
        base = torch.randn(*case.x.shape).to(dtype)
        out = make(base)
        got = kernels.bypass_input_grad(
            case.grad, case.cols, case.rows, case.delta, case.d_in, out=out, backend=backend
        )
        assert got is out
        assert_matches(out, base.double() + case.input_grad(), dtype)


@pytest.mark.parametrize("backend, device", BACKENDS_ON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 20])
def test_products_accumulate_into_out(backend, device, dtype, k):
    check_accumulation(Case(70, 30, 24, k, subset=k == 20, dtype=dtype, device=device), backend)


@pytest.mark.parametrize("backend, device", BACKENDS_ON_DEVICES)
def test_duplicate_columns_across_neurons_sum_in_the_input_gradient(backend, device):
    case = Case(300, 6, 80, 3, device=device)
    case.cols = torch.tensor([[0, 1, 2]] * 80, device=device)
    got = kernels.bypass_input_grad(case.grad, case.cols, None, case.delta, 6, backend=backend)
    assert got[:, 3:].abs().max() == 0
    assert_matches(got, case.input_grad(), torch.float32)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_placements_and_no_tokens_give_zeros(backend):
    case = Case(0, 5, 4, 2)
    assert kernels.sampled_grad(case.x, case.grad, case.cols, backend=backend).abs().sum() == 0
    assert kernels.bypass_forward(case.x, case.cols, None, case.delta, 4, backend=backend).shape == (0, 4)
    # Adding into an empty `out`: empty storages all sit at address 0 yet share no memory.
    out, grad_x = torch.empty(0, 4), torch.empty(0, 5)
    assert kernels.bypass_forward(case.x, case.cols, None, case.delta, 4, out=out, backend=backend) is out
    assert kernels.bypass_input_grad(case.grad, case.cols, None, case.delta, 5, out=grad_x, backend=backend) is grad_x
    none = Case(3, 5, 4, 2)
    empty_rows, empty_cols = torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64)
    out = kernels.bypass_forward(none.x, empty_cols, empty_rows, torch.zeros(0, 2), 4, backend=backend)
    assert out.shape == (3, 4) and out.abs().sum() == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_out_of_range_indices_raise_before_writing(backend):
    case = Case(4, 5, 3, 2, subset=True)
    case.cols[0, 1] = 5
    with pytest.raises(IndexError, match="cols"):
        kernels.sampled_grad(case.x, case.grad, case.cols, case.rows, backend=backend)
    with pytest.raises(IndexError, match="cols"):
        kernels.bypass_forward(case.x, case.cols, case.rows, case.delta, 3, backend=backend)
    case.cols[0, 1], case.rows[0] = 0, -1
    with pytest.raises(IndexError, match="rows"):
        kernels.bypass_input_grad(case.grad, case.cols, case.rows, case.delta, 5, backend=backend)


def test_inconsistent_shapes_are_refused():
    case = Case(4, 5, 3, 2)
    with pytest.raises(ValueError, match="rows=None"):
        kernels.bypass_forward(case.x, case.cols, None, case.delta, 4)
    with pytest.raises(ValueError, match="differ in shape"):
        kernels.bypass_forward(case.x, case.cols, None, case.delta[:, :1], 3)
    with pytest.raises(ValueError, match="tokens"):
        kernels.sampled_grad(case.x[:3], case.grad, case.cols)
    with pytest.raises(ValueError, match="cols must be"):
        kernels.sampled_grad(case.x, case.grad, case.cols.float())
    with pytest.raises(ValueError, match="out must be"):
        kernels.bypass_forward(case.x, case.cols, None, case.delta, 3, out=torch.zeros(4, 4))
    square = Case(4, 5, 5, 2)
    with pytest.raises(ValueError, match="shares memory"):
        kernels.bypass_forward(square.x, square.cols, None, square.delta, 5, out=square.x)


@pytest.fixture
def two_intra_op_threads():
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads_before)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_c_kernels_are_safe_from_several_threads_and_with_intra_op_threads(two_intra_op_threads):
    cases = [Case(200, 64, 96, 8, subset=i % 2 == 1, seed=i) for i in range(6)]
    errors: list[BaseException] = []

    def run(case: Case) -> None:
        try:
            for _ in range(3):
                check_all(case, "cpu")
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    workers = [threading.Thread(target=run, args=(case,)) for case in cases]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors[0]


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_auto_picks_the_c_kernels_on_cpu_and_torch_ops_for_float64():
    case = Case(8, 6, 5, 2)
    assert kernels.choose_backend("sampled_grad", case.x, case.grad) == "cpu"
    assert kernels.choose_backend("sampled_grad", case.x.double(), case.grad.double()) == "torch"
    assert kernels.available_backends("cpu") == ["cpu", "torch"]
    got = kernels.sampled_grad(case.x.double(), case.grad.double(), case.cols)
    assert_matches(got, case.sampled_grad(), torch.float32)


def patched_weight(case: Case, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 (d_out, d_in) weight (a transposed view, as Conv1D's, if asked) and its copy with the deltas added."""
    storage = torch.randn(case.d_in, case.d_out) if transposed else torch.randn(case.d_out, case.d_in)
    weight = storage.T if transposed else storage
    return weight, (weight.double() + case.dense_delta()).float()


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("index", [torch.int16, torch.int32, torch.int64], ids=["int16", "int32", "int64"])
@pytest.mark.parametrize("subset", [False, True], ids=["all-neurons", "subset"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_patching_entries_adds_the_deltas_and_restoring_gives_back_the_exact_weight(index, subset, transposed):
    case = Case(1, 70, 40, 20, subset=subset, index=index)
    weight, expected = patched_weight(case, transposed)
    original = weight.clone()
    entries = kernels.entry_patch(weight, case.cols, case.rows, case.delta)
    entries.restore()  # nothing patched yet: a no-op
    assert torch.equal(weight, original)
    entries.apply()
    assert torch.equal(weight, expected)
    entries.restore()
    assert torch.equal(weight, original)
    entries.restore()  # restored already: a no-op
    assert torch.equal(weight, original)


HALF = [torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s raw bits, so that comparisons see every bit (NaN payloads, signed zeros)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("delta_dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("weight_dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("subset", [False, True], ids=["all-neurons", "subset"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_patched_entries_are_torchs_sum_in_the_weights_type_and_restoring_gives_back_its_bits(
    weight_dtype, delta_dtype, subset, transposed
):
    """What the torch ops of the in-place path write for weights the C kernels do not take: `w + delta.to(w.dtype)`."""
    case = Case(1, 70, 40, 20, subset=subset, dtype=delta_dtype)
    storage = torch.randn(70, 40) if transposed else torch.randn(40, 70)
    weight = (storage.T if transposed else storage).to(weight_dtype)
    original = weight.clone()
    positions = (case.neurons[:, None].expand_as(case.cols), case.cols.long())
    expected = weight.clone().index_put_(positions, weight[positions] + case.delta.to(weight_dtype))
    entries = kernels.entry_patch(weight, case.cols, case.rows, case.delta)
    entries.apply()
    assert torch.equal(bits(weight), bits(expected))
    entries.restore()
    assert torch.equal(bits(weight), bits(original))


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_a_column_repeated_within_a_row_gets_both_deltas_and_restoring_still_gives_back_the_exact_weight():
    weight = torch.randn(6, 10)
    original = weight.clone()
    cols = torch.tensor([[3, 3, 7]] * 6)
    delta = torch.randn(6, 3)
    entries = kernels.entry_patch(weight, cols, None, delta)
    entries.apply()
    assert torch.equal(weight[:, 3], (original[:, 3] + delta[:, 0]) + delta[:, 1])
    entries.restore()
    assert torch.equal(weight, original)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_patching_entries_that_are_patched_already_is_refused_before_writing():
    case = Case(1, 9, 6, 2)
    weight, expected = patched_weight(case, transposed=False)
    entries = kernels.entry_patch(weight, case.cols, None, case.delta)
    entries.apply()
    with pytest.raises(RuntimeError, match="patched already"):
        entries.apply()
    assert torch.equal(weight, expected)
    entries.restore()


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_patching_out_of_range_entries_raises_before_writing_and_leaves_nothing_to_restore():
    case = Case(1, 9, 6, 2)
    weight, _ = patched_weight(case, transposed=False)
    original = weight.clone()
    bad = case.cols.clone()
    bad[-1, -1] = 9
    entries = kernels.entry_patch(weight, bad, None, case.delta)
    with pytest.raises(IndexError, match="cols has an index outside"):
        entries.apply()
    entries.restore()
    assert torch.equal(weight, original)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
@pytest.mark.parametrize(
    "change, error",
    [
        ({"weight": torch.zeros(6, 9, dtype=torch.float64)}, "float16 CPU tensors"),
        ({"weight": torch.zeros(5, 9)}, "rows=None means every neuron"),
        ({"delta": torch.zeros(6, 2, dtype=torch.float64)}, "float16 CPU tensors"),
        ({"delta": torch.zeros(6, 1)}, "differ in shape"),
    ],
    ids=["float64-weight", "fewer-rows", "float64-delta", "small-delta"],
)
def test_entry_kernels_refuse_tensors_they_would_read_or_write_out_of_bounds(change, error):
    case = Case(1, 9, 6, 2)
    args = {"weight": torch.zeros(6, 9), "delta": case.delta} | change
    original = args["weight"].clone()
    with pytest.raises((TypeError, ValueError), match=error):
        kernels.entry_patch(args["weight"], case.cols, None, args["delta"])
    assert torch.equal(args["weight"], original)


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
def test_the_in_place_path_patches_weights_of_the_kernels_dtypes_with_the_c_kernels_and_others_with_torch_ops():
    kernel_dtypes = [torch.float32, *HALF]
    for weight_dtype, delta_dtype in itertools.product(kernel_dtypes, kernel_dtypes):
        assert kernels.patches_entries(torch.zeros(4, 3, dtype=weight_dtype), torch.zeros(4, 1, dtype=delta_dtype))
    assert not kernels.patches_entries(torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4, 1))
    assert not kernels.patches_entries(torch.zeros(4, 3), torch.zeros(4, 1, dtype=torch.float64))


@pytest.mark.skipif(not cpu.available(), reason="no C compiler")
@pytest.mark.parametrize("layout", sorted(cpu.SAMPLED_GRAD_LAYOUTS))
def test_the_c_delta_gradient_reports_where_its_time_goes_when_asked(two_intra_op_threads, layout):
    case = Case(700, 64, 96, 8, subset=True, dtype=torch.bfloat16)  # both layouts convert (pack) x and grad
    phases: dict[str, float] = {}
    start = time.perf_counter()
    got = cpu.sampled_grad(case.x, case.grad, case.cols, case.rows, phases, layout)
    elapsed = time.perf_counter() - start
    assert_matches(got, case.sampled_grad(), torch.float32)
    assert list(phases) == list(cpu.SAMPLED_GRAD_PHASES)
    assert all(seconds > 0 for seconds in phases.values()) and sum(phases.values()) <= elapsed


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and no library loaded yet in this process."""
    monkeypatch.setenv("PEFT_NEUROADA_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "_library", cpu._UNLOADED)
    return tmp_path


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"], ids=["missing", "failing"])
def test_without_a_working_compiler_everything_falls_back_to_torch_ops(fresh_build, monkeypatch, caplog, compiler):
    monkeypatch.setenv("CC", compiler)
    case = Case(12, 9, 7, 3, subset=True)
    assert kernels.available_backends("cpu") == ["torch"]
    assert kernels.choose_backend("bypass_forward", case.x, case.delta) == "torch"
    check_all(case, "auto")
    assert "using the slower torch ops" in caplog.text
    assert not list(fresh_build.rglob("*.so"))
    with pytest.raises(RuntimeError, match="not available"):
        kernels.sampled_grad(case.x, case.grad, case.cols, case.rows, backend="cpu")


def test_a_missing_kernel_source_falls_back_to_torch_ops(fresh_build, monkeypatch, caplog):
    """A stripped install without neuroada_cpu.c still imports (the source is read at import) and computes."""
    monkeypatch.setattr(cpu, "SOURCE_TEXT", None)
    assert kernels.available_backends("cpu") == ["torch"]
    assert "neuroada_cpu.c is missing; using the slower torch ops" in caplog.text
    check_all(Case(12, 9, 7, 3), "auto")


@pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler")
def test_the_built_library_is_cached_and_reused(fresh_build, monkeypatch):
    assert cpu.library() is not None
    (built,) = fresh_build.rglob("neuroada_cpu-*.so")
    monkeypatch.setattr(cpu, "_library", cpu._UNLOADED)
    monkeypatch.setattr(cpu, "_build", lambda *args: pytest.fail("rebuilt although cached"))
    assert cpu.library() is not None
    assert list(fresh_build.rglob("*.so")) == [built]


@pytest.mark.skipif(cpu.compiler() is None, reason="no C compiler")
def test_the_library_is_built_from_the_source_its_bindings_were_imported_with(fresh_build, monkeypatch):
    """A source file edited while a process runs (an editable install) never pairs a new library with the argument
    types declared for the old one."""
    edited = fresh_build / "neuroada_cpu.c"
    edited.write_text("int na_sampled_grad(void) { return 3; }  /* another signature */\n")
    monkeypatch.setattr(cpu, "SOURCE", edited)
    assert cpu.library() is not None
    check_all(Case(37, 50, 70, 5), "cpu")


def _mapped_libraries(name: str) -> set[str]:
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if name in line}


@pytest.mark.skipif(not cpu.available() or sys.platform != "linux", reason="needs the C kernels on Linux")
@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="torch is not built with OpenMP")
def test_c_kernels_run_on_torchs_own_openmp_threads(two_intra_op_threads):
    check_all(Case(1024, 64, 96, 8), "cpu")
    assert cpu.library().na_uses_openmp() == 1
    assert len(_mapped_libraries("libgomp")) == 1, _mapped_libraries("libgomp")


def use_compiler_script(monkeypatch, path: Path, before: str = "", after: str = "") -> None:
    """Build the kernels with a shell script as `CC`: `before` runs first, then the real compiler with the build's
    arguments followed by `after`."""
    path.write_text(f'#!/bin/sh\n{before}exec {shlex.join(cpu.compiler())} "$@"{after}\n')
    path.chmod(0o755)
    monkeypatch.setenv("CC", str(path))


@pytest.mark.skipif(cpu.compiler() is None or sys.platform != "linux", reason="needs a C compiler on Linux")
def test_a_compiler_without_openmp_builds_kernels_on_their_own_threads(fresh_build, monkeypatch, two_intra_op_threads):
    use_compiler_script(monkeypatch, fresh_build / "cc-without-openmp", 'case "$*" in *-fopenmp*) exit 1;; esac\n')
    assert cpu.library().na_uses_openmp() == 0
    check_all(Case(1024, 64, 96, 8, subset=True), "cpu")


def _cpu_flags() -> set[str]:
    """The feature flags in the CPU identity the kernel cache is keyed by (empty where /proc/cpuinfo lists none)."""
    lines = cpu._cpu_identity().splitlines()
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


# x86-64-v3's instructions as /proc/cpuinfo names them (abm: LZCNT): code built for it must not run without them
X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}


@pytest.mark.skipif(cpu.compiler() is None or platform.machine() != "x86_64", reason="needs a C compiler on x86-64")
@pytest.mark.parametrize(
    "march, width",
    [
        pytest.param(
            "x86-64-v3", 8, id="avx2", marks=pytest.mark.skipif(not X86_64_V3 <= _cpu_flags(), reason="no AVX2")
        ),
        pytest.param("x86-64", 4, id="sse"),
    ],
)
def test_kernels_built_for_narrower_vector_units_give_the_same_products(fresh_build, monkeypatch, march, width):
    """The vector width is fixed when the library is built for the machine (-march=native); older CPUs get the 8- and
    4-lane code paths, checked here on whatever CPU runs the suite."""
    use_compiler_script(monkeypatch, fresh_build / f"cc-{march}", after=f" -march={march}")
    assert cpu.library().na_vector_width() == width
    for shape in SHAPES[1:4] + [(515, 200, 130, 1)]:
        check_all(Case(*shape, subset=shape[3] == 5), "cpu")
    check_all(Case(77, 60, 33, 9, dtype=torch.bfloat16), "cpu")
    for case in (Case(515, 200, 130, 1), Case(77, 60, 33, 3, subset=True, dtype=torch.bfloat16)):
        got = cpu.sampled_grad(case.x, case.grad, case.cols, case.rows, layout="gather")
        assert_matches(got, case.sampled_grad(), torch.float32)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_dense_reference_in_the_interpreter():
    """In a fresh process: the interpreter must be on before anything (torch.compile does) imports triton."""
    worker = Path(__file__).with_name("triton_interpreter_worker.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checked" in result.stdout


@ON_GPU
def test_auto_picks_triton_on_the_gpu_and_torch_ops_for_a_deterministic_input_gradient():
    case = Case(8, 6, 5, 2, device="cuda")
    assert kernels.available_backends("cuda") == ["triton", "torch"]
    assert kernels.choose_backend("sampled_grad", case.x, case.grad) == "triton"
    assert kernels.choose_backend("bypass_input_grad", case.grad, case.delta) == "triton"
    torch.use_deterministic_algorithms(True)
    try:
        assert kernels.choose_backend("bypass_input_grad", case.grad, case.delta) == "torch"
        assert kernels.choose_backend("bypass_forward", case.x, case.delta) == "triton"
    finally:
        torch.use_deterministic_algorithms(False)
    check_all(case, "auto")
