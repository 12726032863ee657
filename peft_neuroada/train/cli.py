"""The `neuroada` console command: `train`, `eval`, `compare` recipes from configs/, the `demo` main job,
`prompts` / `score` to inspect a protocol's prompts and re-score saved predictions, and `estimate` to plan a run's
memory."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from pathlib import Path

PROTOCOL_NAMES = ("lenient", "paper")
"""protocols.PROTOCOLS' names, spelled out so that `neuroada --help` needs none of the training extra."""
ESTIMATE_METHODS = ("neuroada", "lora", "mask", "full", "frozen")
"""estimate.METHODS, spelled out so that building the parser does not import the estimator."""
TRAINING_EXTRA = ("datasets", "yaml", "gguf", "tqdm")
"""What `pip install -e ".[train]"` adds to the core plugin (gguf only for the embedded default model)."""

_SET_HELP = "override a recipe value, e.g. --set training.max_steps=20 --set data.dir=/data (repeatable)"


def count(text: str) -> int:
    """An argument that counts something (k, sequences, tokens): a whole number of at least 1. argparse names the
    argument in its one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuroada", description="Fine-tune and evaluate NeuroAda (or LoRA) adapters from YAML recipes."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="fine-tune a recipe, save its adapter and evaluate it")
    train.add_argument("config", type=Path)
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP)
    train.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")

    evaluate = commands.add_parser("eval", help="evaluate a recipe's trained adapter (or the base model)")
    evaluate.add_argument("config", type=Path)
    evaluate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP)
    which = evaluate.add_mutually_exclusive_group()
    which.add_argument("--adapter", type=Path, help="adapter folder (default: OUTPUT_DIR/adapter of the recipe)")
    which.add_argument("--base", action="store_true", help="evaluate the base model without any adapter")
    evaluate.add_argument("--output", type=Path, help="where results.json/.csv go (default: in OUTPUT_DIR)")

    compare = commands.add_parser("compare", help="train and evaluate several recipes and tabulate them")
    compare.add_argument("configs", type=Path, nargs="+")
    compare.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP)
    compare.add_argument("--output", type=Path, default=Path("outputs/compare"), help="where comparison.* go")
    compare.add_argument("--no-base", action="store_true", help="do not evaluate the untrained base model")

    prompts = commands.add_parser(
        "prompts", help="print the exact prompt the model is given for the first N test examples, as JSON lines"
    )
    prompts.add_argument("--data-dir", type=Path, required=True, help="folder holding TASK/test.json")
    prompts.add_argument("--task", required=True, help="test set name, e.g. boolq or gsm8k")
    prompts.add_argument("--n", type=int, required=True, help="how many examples, from the start of the file")
    prompts.add_argument("--protocol", choices=PROTOCOL_NAMES, default="lenient", help="default: lenient")

    score = commands.add_parser("score", help="re-score saved predictions (JSON lines, e.g. eval's predictions files)")
    score.add_argument("predictions", type=Path, nargs="+", help="files with task, prompt, response, answer per line")
    score.add_argument("--protocol", choices=PROTOCOL_NAMES, required=True)
    score.add_argument("--out", type=Path, required=True, help="where the lines go, each with `correct` set")

    demo = commands.add_parser(
        "demo",
        help="the main job: NeuroAda on SmolLM2-135M, generated tasks, about 8 min on a 2-core CPU",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--output", type=Path, default=Path("outputs/neuroada-demo"), help="data, adapter, report")
    demo.add_argument("--steps", type=int, default=80, help="training steps")
    demo.add_argument("--k", type=int, default=1, help="inputs tuned per neuron")
    demo.add_argument("--learning-rate", type=float, default=1e-2, help="AdamW learning rate")
    demo.add_argument("--train-size", type=int, default=300, help="generated training examples per task")
    demo.add_argument("--test-size", type=int, default=40, help="generated test examples per task")

    estimate = commands.add_parser(
        "estimate",
        help="the memory a training run takes per method, from the model's config alone (nothing else is loaded)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    estimate.add_argument("model", help="a config.json, a model folder, or a hub id (only its config.json is fetched)")
    estimate.add_argument("--k", type=count, nargs="+", default=[1, 20], help="NeuroAda's k (LoRA at each k's budget)")
    estimate.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    estimate.add_argument("--batch", type=count, default=1, help="sequences per step")
    estimate.add_argument("--seq", type=count, default=512, help="tokens per sequence")
    estimate.add_argument("--quantize", choices=("nf4",), help="the base loaded in 4 bits (QLoRA's)")
    estimate.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where AdamW steps")
    estimate.add_argument(
        "--methods",
        nargs="+",
        choices=ESTIMATE_METHODS,
        default=["neuroada", "lora", "mask", "full"],
        help="what to estimate",
    )
    return parser


def require_training_extra() -> None:
    """The command's packages are an extra of the plugin; say how to get them rather than fail on an import."""
    missing = [name for name in TRAINING_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"The neuroada command needs the training extra ({', '.join(missing)} missing): "
            'pip install -e ".[train]" (or pip install "peft-neuroada[train]").'
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "estimate":  # transformers and peft are all it needs
        return _estimate(args)
    require_training_extra()
    # Imported late so `neuroada --help` works without the training extra (it still waits for peft to import).
    from .recipes import RecipeError
    from .scoring import PredictionsError

    try:
        return _run(args)
    except (RecipeError, PredictionsError, FileNotFoundError) as error:  # what the user named is wrong: say what
        raise SystemExit(f"neuroada {args.command}: error: {error}") from None


def _run(args: argparse.Namespace) -> int:
    from . import runs
    from .recipes import load_recipe

    if args.command == "train":
        runs.train_and_evaluate(load_recipe(args.config, args.overrides), evaluate=not args.no_eval)
    elif args.command == "eval":
        recipe = load_recipe(args.config, args.overrides)
        adapter = None if args.base else (args.adapter or recipe.adapter_dir)
        runs.evaluate_saved(recipe, adapter, args.output)
    elif args.command == "compare":
        recipes = [load_recipe(config, args.overrides) for config in args.configs]
        runs.compare(recipes, args.output, include_base=not args.no_base)
    elif args.command == "prompts":
        runs.print_prompts(args.data_dir, args.task, args.n, args.protocol)
    elif args.command == "score":
        runs.rescore(args.predictions, args.protocol, args.out)
    else:
        from .demo import print_report, run_demo

        report = run_demo(args.output, args.steps, args.train_size, args.test_size, args.k, args.learning_rate)
        print_report(report)
        return 0 if report.merged_matches else 1
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from .estimate import UNKNOWN, estimate, format_table

    try:
        rows = estimate(args.model, args.k, args.methods, args.dtype, args.batch, args.seq, args.quantize, args.device)
    except (OSError, ValueError) as error:
        raise SystemExit(f"neuroada estimate: error: {error}") from None
    quantized = f", {args.quantize} base" if args.quantize else ""
    print(f"{args.model}: {args.dtype}{quantized}, batch {args.batch} x {args.seq} tokens, AdamW on {args.device}\n")
    print(format_table(rows))
    print(f"\n{UNKNOWN}")
    return 0
