"""Per-op candidates for one NeuroAda layer: which kernel should compute the delta gradient and the forward?

    python benchmarks/primitives.py                      # 512 tokens x (576 -> 1536), k = 1 and 20
    python benchmarks/primitives.py --tokens 256 --d-in 1536 --d-out 4096 --threads 2
    python benchmarks/primitives.py --device cuda        # the same candidates on CUDA (cuSPARSE), wall clock

Every candidate is checked against a plain reference before it is timed. Times are medians over repeated calls of
both wall-clock and process CPU time; ratios are to the layer's dense forward matmul (`x @ W.T`), the unit a frozen
layer pays once in forward and once in backward. The selection group prices keeping no index: the top-k selection
that would then run again at every visit. The last group times whole layers through the public API (forward +
backward with input gradients, as inside a model): a frozen `nn.Linear` (the floor: 2 units), NeuroAda, and LoRA at
the same parameter budget.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import interleaved_samples, markdown_table
from peft import LoraConfig, get_peft_model
from torch import nn

from peft_neuroada import NeuroAdaConfig
from peft_neuroada.accel import sparse_products
from peft_neuroada.budget import lora_rank_for_k
from peft_neuroada.tuner.forward import Placement, merged_copy


@dataclass
class Layer:
    """One layer's tensors: input x (T, d_in), weight W (d_out, d_in), upstream gradient g (T, d_out), k deltas/row."""

    x: torch.Tensor
    weight: torch.Tensor
    grad_out: torch.Tensor
    cols: torch.Tensor  # (d_out, k) int64, the top-|w| input columns of each row
    delta: torch.Tensor  # (d_out, k)

    @classmethod
    def random(cls, tokens: int, d_in: int, d_out: int, k: int, device: str = "cpu") -> Layer:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(d_out, d_in, generator=generator) / d_in**0.5
        return cls(
            x=torch.randn(tokens, d_in, generator=generator).to(device),
            weight=weight.to(device),
            grad_out=torch.randn(tokens, d_out, generator=generator).to(device),
            cols=weight.abs().topk(k, dim=1).indices.sort(dim=1).values.to(device),
            delta=(torch.randn(d_out, k, generator=generator) * 0.01).to(device),
        )

    @property
    def k(self) -> int:
        return self.cols.shape[1]

    def flat_positions(self) -> torch.Tensor:
        rows = torch.arange(self.weight.shape[0], device=self.cols.device).unsqueeze(1)
        return (rows * self.weight.shape[1] + self.cols).flatten()

    def csr(self, values: torch.Tensor) -> torch.Tensor:
        """The (d_out, d_in) CSR matrix with `values` (d_out, k) at the selected columns."""
        d_out, k = self.cols.shape
        crow = torch.arange(0, d_out * k + 1, k, device=self.cols.device)
        return torch.sparse_csr_tensor(crow, self.cols.flatten(), values.flatten(), self.weight.shape)


# ----------------------------------------------------------------------------- delta gradient: (g^T x)[i, cols[i]]


def grad_dense_gather(layer: Layer) -> torch.Tensor:
    """The full d_out x d_in weight gradient (what mask-based tuning pays), then the k wanted entries."""
    return (layer.grad_out.T @ layer.x).gather(1, layer.cols)


def grad_column_loop(layer: Layer) -> torch.Tensor:
    """k passes: gather x's columns in row-major order, multiply by g, reduce over tokens."""
    columns = [(layer.x.index_select(1, layer.cols[:, j]) * layer.grad_out).sum(0) for j in range(layer.k)]
    return torch.stack(columns, dim=1)


def grad_sampled_addmm(layer: Layer) -> torch.Tensor:
    """One sampled dense-dense matmul on the CSR pattern (pattern built per call, as a backward would)."""
    pattern = layer.csr(torch.zeros_like(layer.delta))
    return torch.sparse.sampled_addmm(pattern, layer.grad_out.T, layer.x, beta=0.0).values().view_as(layer.delta)


def grad_row_gather_bmm(layer: Layer) -> torch.Tensor:
    """Gather rows of x^T into (d_out, k, T), then a batched (k x T) @ (T x 1) product per neuron."""
    gathered = layer.x.T.contiguous()[layer.cols]
    return torch.bmm(gathered, layer.grad_out.T.unsqueeze(2)).squeeze(2)


def grad_vectorized_gather(layer: Layer) -> torch.Tensor:
    """All k columns at once: x[:, cols] is (T, d_out, k), times g, summed over tokens (T*d_out*k temporary)."""
    return (layer.x[:, layer.cols] * layer.grad_out.unsqueeze(2)).sum(0)


# ------------------------------------------------------------------------------------- forward: x (W + P∘Θ)^T


def fwd_base(layer: Layer) -> torch.Tensor:
    """The frozen layer alone: the floor every variant is compared with."""
    return F.linear(layer.x, layer.weight)


def fwd_merged_copy(layer: Layer) -> torch.Tensor:
    """NeuroAda's path for batches: one dense matmul on a transient copy W + P∘Θ (the frozen weight is not written)."""
    return F.linear(layer.x, merged_copy(layer.weight, [Placement(layer.cols)], [layer.delta]))


def fwd_inplace_merge(layer: Layer) -> torch.Tensor:
    """Add the deltas into W's own storage, one dense matmul, write the originals back (no copy, but it writes the
    frozen weight, which threads and shared weights cannot allow)."""
    weight, cols = layer.weight, layer.cols
    originals = weight.gather(1, cols)
    weight.scatter_add_(1, cols, layer.delta)
    out = F.linear(layer.x, weight)
    weight.scatter_(1, cols, originals)
    return out


def fwd_csr_mm(layer: Layer) -> torch.Tensor:
    """Dense matmul plus a CSR sparse-dense product for the bypass."""
    return F.linear(layer.x, layer.weight) + torch.sparse.mm(layer.csr(layer.delta), layer.x.T).T


def fwd_gather(layer: Layer) -> torch.Tensor:
    """Dense matmul plus k gathered columns of x scaled by the deltas (NeuroAda's general sparse bypass)."""
    bypass = sum(layer.x.index_select(1, layer.cols[:, j]) * layer.delta[:, j] for j in range(layer.k))
    return F.linear(layer.x, layer.weight) + bypass


def fwd_scatter_add(layer: Layer) -> torch.Tensor:
    """The paper code: materialise W + scatter(delta) as a new dense weight, then matmul."""
    weight = layer.weight
    merged = weight.flatten().scatter_add(0, layer.flat_positions(), layer.delta.flatten()).view_as(weight)
    return F.linear(layer.x, merged)


# ------------------------------------------------------------------------------------ input gradient: g (W + P∘Θ)


def bwd_input_base(layer: Layer) -> torch.Tensor:
    return layer.grad_out @ layer.weight


def bwd_input_merged_copy(layer: Layer) -> torch.Tensor:
    return layer.grad_out @ merged_copy(layer.weight, [Placement(layer.cols)], [layer.delta])


def bwd_input_inplace_merge(layer: Layer) -> torch.Tensor:
    weight, cols = layer.weight, layer.cols
    originals = weight.gather(1, cols)
    weight.scatter_add_(1, cols, layer.delta)
    out = layer.grad_out @ weight
    weight.scatter_(1, cols, originals)
    return out


def bwd_input_reference(layer: Layer) -> torch.Tensor:
    return layer.grad_out @ (layer.weight + layer.csr(layer.delta).to_dense())


def fwd_reference(layer: Layer) -> torch.Tensor:
    return F.linear(layer.x, layer.weight + layer.csr(layer.delta).to_dense())


# ----------------------------------------------------- selection: what a mode keeping no index would pay per visit


def selected_columns(layer: Layer) -> torch.Tensor:
    return layer.cols


def select_top_magnitude(layer: Layer) -> torch.Tensor:
    """Each row's top-k |w| columns selected again from the frozen weight (stored indices make this a one-off)."""
    return layer.weight.abs().topk(layer.k, dim=1, sorted=False).indices.sort(dim=1).values


# ------------------------------------------------------ the plugin's CPU products (accel/sparse_products)


def bypass_fwd_reference(layer: Layer) -> torch.Tensor:
    return layer.x @ layer.csr(layer.delta).to_dense().T


def bypass_input_reference(layer: Layer) -> torch.Tensor:
    return layer.grad_out @ layer.csr(layer.delta).to_dense()


def product_candidates() -> dict[str, Callable[[Layer], torch.Tensor]]:
    """The plugin's three products on the CPU (`sparse_products`), alone and as the bypass uses them: added to the
    base layer's output."""

    def grad(layer: Layer) -> torch.Tensor:
        return sparse_products.sampled_grad(layer.x, layer.grad_out, layer.cols, None)

    def bypass(layer: Layer) -> torch.Tensor:
        return sparse_products.bypass_forward(layer.x, layer.cols, None, layer.delta, layer.weight.shape[0])

    def bypass_input(layer: Layer) -> torch.Tensor:
        return sparse_products.bypass_input_grad(layer.grad_out, layer.cols, None, layer.delta, layer.weight.shape[1])

    def base_plus_bypass(layer: Layer) -> torch.Tensor:
        return F.linear(layer.x, layer.weight) + bypass(layer)

    def input_base_plus_bypass(layer: Layer) -> torch.Tensor:
        return layer.grad_out @ layer.weight + bypass_input(layer)

    return {
        "delta grad": grad,
        "bypass fwd": bypass,
        "bypass input grad": bypass_input,
        "forward": base_plus_bypass,
        "input grad": input_base_plus_bypass,
    }


# ---------------------------------------------------------------- whole layer, public API: fwd + bwd with input grads


class _OneLayer(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(weight)
        self.proj.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def layer_step(module: nn.Module, layer: Layer) -> torch.Tensor:
    """Forward and backward as inside a model: input gradient always, parameter gradients where trainable."""
    x = layer.x.detach().requires_grad_(True)
    module(x).backward(layer.grad_out)
    for param in module.parameters():
        param.grad = None
    return x.grad


def layer_modules(layer: Layer) -> dict[str, nn.Module]:
    """Frozen layer, NeuroAda with the layer's k, and LoRA with the rank closest to the same parameter count."""
    d_out, d_in = layer.weight.shape
    rank = lora_rank_for_k([(d_out, d_in)], layer.k)
    configs = {
        f"neuroada k={layer.k}": NeuroAdaConfig(k=layer.k, target_modules=["proj"]),
        f"lora r={rank}": LoraConfig(r=rank, target_modules=["proj"]),
    }
    device = layer.weight.device
    adapted = {name: get_peft_model(_OneLayer(layer.weight), config).to(device) for name, config in configs.items()}
    return {"frozen nn.Linear": _OneLayer(layer.weight).to(device), **adapted}


CANDIDATES: dict[str, tuple[Callable[[Layer], torch.Tensor], list[Callable[[Layer], torch.Tensor]]]] = {
    # group: (reference, candidates); the tuner's products join these groups in `layer_calls`
    "forward": (
        fwd_reference,
        [fwd_base, fwd_merged_copy, fwd_inplace_merge, fwd_csr_mm, fwd_gather, fwd_scatter_add],
    ),
    "bypass fwd": (bypass_fwd_reference, []),
    "delta grad": (
        grad_dense_gather,
        [grad_dense_gather, grad_column_loop, grad_sampled_addmm, grad_row_gather_bmm, grad_vectorized_gather],
    ),
    "input grad": (bwd_input_reference, [bwd_input_base, bwd_input_merged_copy, bwd_input_inplace_merge]),
    "bypass input grad": (bypass_input_reference, []),
    "selection": (selected_columns, [select_top_magnitude]),
}


def interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median wall and process-CPU seconds of each call, timed interleaved after one warmup call each."""
    for fn in calls.values():
        fn()
    samples = interleaved_samples(calls, repeats)
    return {name: (statistics.median(wall), statistics.median(cpu)) for name, (wall, cpu) in samples.items()}


def check(layer: Layer, reference: Callable[[Layer], torch.Tensor], fn: Callable[[Layer], torch.Tensor]) -> None:
    """Fail loudly if a candidate computes something else (the base forward is exact only without deltas)."""
    if fn in (fwd_base, bwd_input_base):
        return
    expected, got = reference(layer), fn(layer)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3, msg=f"{fn.__name__} disagrees with reference")


def layer_calls(layer: Layer) -> dict[tuple[str, str], Callable[[], object]]:
    """Every timed call for one layer, keyed by (group, candidate); each op candidate is checked first."""
    calls: dict[tuple[str, str], Callable[[], object]] = {}
    for group, (reference, candidates) in CANDIDATES.items():
        for fn in candidates:
            check(layer, reference, fn)
            calls[group, fn.__name__.split("_", 1)[1]] = lambda fn=fn: fn(layer)
    for group, fn in product_candidates().items():
        check(layer, CANDIDATES[group][0], fn)
        prefix = "base + " if group in ("forward", "input grad") else ""
        calls[group, f"{prefix}products"] = lambda fn=fn: fn(layer)
    for name, module in layer_modules(layer).items():
        calls["layer fwd+bwd", name] = lambda module=module: layer_step(module, layer)
    if layer.x.is_cuda:  # time the kernels, not their launches
        calls = {key: lambda fn=fn: (fn(), torch.cuda.synchronize()) for key, fn in calls.items()}
    order = [*CANDIDATES, "layer fwd+bwd"]
    return dict(sorted(calls.items(), key=lambda item: order.index(item[0][0])))


def run(
    tokens: int, d_in: int, d_out: int, ks: list[int], repeats: int, clock: str, device: str = "cpu"
) -> list[list[str]]:
    rows = []
    for k in ks:
        times = interleaved_medians(layer_calls(Layer.random(tokens, d_in, d_out, k, device)), repeats)
        unit = times["forward", "base"][clock == "cpu"]
        for (group, name), (wall, cpu) in times.items():
            chosen = cpu if clock == "cpu" else wall
            rows.append([group, name, str(k), f"{wall * 1e6:,.0f}", f"{cpu * 1e6:,.0f}", f"{chosen / unit:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--d-in", type=int, default=576)
    parser.add_argument("--d-out", type=int, default=1536)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 20])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="1 keeps CPU-time figures honest on a shared machine.")
    parser.add_argument("--clock", choices=["cpu", "wall"], help="Time the ratio column uses (cpu; wall on cuda).")
    parser.add_argument("--device", default="cpu", help="cpu or cuda.")
    args = parser.parse_args()
    clock = args.clock or ("wall" if args.device.startswith("cuda") else "cpu")
    torch.set_num_threads(args.threads)
    rows = run(args.tokens, args.d_in, args.d_out, args.k, args.repeats, clock, args.device)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"threads={args.threads}"
    print(
        f"{args.tokens} tokens x ({args.d_in} -> {args.d_out}), float32, {args.device} {where}, "
        f"torch {torch.__version__}\n"
    )
    print(markdown_table(["op", "candidate", "k", "wall (us)", "CPU (us)", f"/ base matmul ({clock})"], rows))


if __name__ == "__main__":
    main()
