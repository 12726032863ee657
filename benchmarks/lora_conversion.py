"""What peft's `convert_to_lora` keeps of a NeuroAda adapter on SmolLM2-135M, at k=1 and k=20.

The adapter is trained briefly (Adam at 1e-2 on commonsense_15k from ../shared/datasets), then converted at several
ranks. Per rank: the share of the deltas' squared Frobenius norm the truncated SVD keeps (over all layers, and the
median layer's), the LoRA's parameter count against NeuroAda's, and how close the converted model's next-token
distributions are to the adapter's on held-out examples (KL divergence, top-1 agreement), against the base model's.

    python benchmarks/lora_conversion.py            # writes docs/study/lora-conversion.json
    python benchmarks/lora_conversion.py --figure   # docs/study/lora-conversion.png from the JSON
"""

from __future__ import annotations

import argparse
import json
import time

from common import REPO_ROOT, machine

DATA = REPO_ROOT.parent / "shared" / "datasets"
RESULTS = REPO_ROOT / "docs" / "study" / "lora-conversion.json"
FIGURE = RESULTS.with_suffix(".png")
BUDGETS = (1, 20)
RANKS = (1, 4, 16, 64, 256)
CONVERTED_RANKS = (16, 64)  # converted end to end (the others from the same singular values)
STEPS, BATCH, MAX_LENGTH, LEARNING_RATE = 40, 4, 96, 1e-2


def batches(tokenizer, split: str, count: int, seed: int) -> list[dict]:
    import torch

    from peft_neuroada.train.data import load_split, tokenize_for_training

    examples = load_split(DATA, ["commonsense_15k"], split, count * BATCH, seed)
    rows = [tokenize_for_training(example, tokenizer, MAX_LENGTH) for example in examples]
    out = []
    for start in range(0, len(rows), BATCH):
        chunk = rows[start : start + BATCH]
        width = max(len(row["input_ids"]) for row in chunk)
        fills = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "labels": -100}
        out.append({key: torch.tensor([row[key] + [fill] * (width - len(row[key])) for row in chunk])
                    for key, fill in fills.items()})  # fmt: skip
    return out


def next_token_log_probs(model, held_out: list[dict]):
    import torch

    with torch.no_grad():
        outputs = []
        for batch in held_out:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            outputs.append(logits[batch["attention_mask"].bool()].log_softmax(-1))
        return torch.cat(outputs)


def closeness(reference, other) -> dict[str, float]:
    kl = (reference.exp() * (reference - other)).sum(-1).mean().item()
    agreement = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    return {"kl": kl, "top1_agreement": agreement}


def measure(k: int) -> dict:
    import torch
    from peft import get_peft_model, set_peft_model_state_dict
    from peft.tuners.lora import convert_to_lora

    from peft_neuroada import NeuroAdaConfig, NeuroAdaLayer
    from peft_neuroada.train.models import load_default_model

    torch.manual_seed(0)
    base, tokenizer = load_default_model()
    train, held_out = batches(tokenizer, "train", STEPS, 0), batches(tokenizer, "validation", 4, 1)
    base_log_probs = next_token_log_probs(base, held_out)
    model = get_peft_model(base, NeuroAdaConfig(k=k))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    model.train()
    for batch in train:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    adapted = next_token_log_probs(model, held_out)
    squared = {name: torch.linalg.svdvals(layer.get_additive_delta("default").float()).square()
               for name, layer in model.named_modules() if isinstance(layer, NeuroAdaLayer)}  # fmt: skip
    total = sum(values.sum() for values in squared.values())
    record = {"k": k, "neuroada_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    record["base"] = closeness(adapted, base_log_probs)
    record["ranks"] = []
    for rank in RANKS:
        shares = torch.stack([values[:rank].sum() / values.sum() for values in squared.values()])
        kept = sum(values[:rank].sum() for values in squared.values()) / total
        entry = {"rank": rank, "energy_kept": kept.item(), "median_layer_energy_kept": shares.median().item()}
        if rank in CONVERTED_RANKS:
            lora_config, state_dict = convert_to_lora(model, rank=rank)
            lora_base, _ = load_default_model()
            converted = get_peft_model(lora_base, lora_config)
            assert not set_peft_model_state_dict(converted, state_dict).unexpected_keys
            entry["lora_parameters"] = sum(p.numel() for p in converted.parameters() if p.requires_grad)
            entry |= closeness(adapted, next_token_log_probs(converted.eval(), held_out))
        record["ranks"].append(entry)
    record["full_rank_median"] = int(torch.tensor([int((v > 0).sum()) for v in squared.values()]).median())
    return record


def figure() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(RESULTS.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for record in data["budgets"]:
        ranks = [entry["rank"] for entry in record["ranks"]]
        label = f"k={record['k']}"
        axes[0].plot(ranks, [entry["energy_kept"] for entry in record["ranks"]], marker="o", label=label)
        converted = [entry for entry in record["ranks"] if "kl" in entry]
        axes[1].plot([e["rank"] for e in converted], [e["kl"] for e in converted], marker="o", label=label)
        axes[1].axhline(record["base"]["kl"], linestyle=":", color=axes[1].lines[-1].get_color())
    axes[0].set(xscale="log", xlabel="LoRA rank", ylabel="share of the deltas' energy kept", ylim=(0, 1.02))
    axes[1].set(xscale="log", yscale="log", xlabel="LoRA rank", ylabel="KL(adapter || converted), nats/token")
    axes[0].set_title("What the truncated SVD keeps")
    axes[1].set_title("Converted model vs the adapter (dotted: base model)")
    for axis in axes:
        axis.legend()
        axis.grid(alpha=0.3)
    fig.suptitle(f"peft's convert_to_lora on a NeuroAda adapter, SmolLM2-135M ({data['settings']['steps']} steps)")
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--figure", action="store_true", help="Only draw the figure from the committed JSON.")
    if parser.parse_args().figure:
        return figure()
    import peft
    import torch

    start = time.time()
    budgets = [measure(k) for k in BUDGETS]
    settings = {"steps": STEPS, "batch": BATCH, "max_length": MAX_LENGTH, "learning_rate": LEARNING_RATE}
    versions = {"torch": torch.__version__, "peft": peft.__version__}
    record = {"settings": settings, "versions": versions, "machine": machine(), "budgets": budgets}
    record["seconds"] = round(time.time() - start)
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    figure()
    print(json.dumps(budgets, indent=1))


if __name__ == "__main__":
    main()
