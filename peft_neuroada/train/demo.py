"""The main job in one command: fine-tune the embedded SmolLM2-135M-Instruct with NeuroAda on generated tasks.

Evaluates before and after training, saves the adapter, reloads it with `PeftModel.from_pretrained`, merges it
with `merge_and_unload` and checks the merged model answers exactly as the trained one did. Runs in about 8 minutes
on 2 CPU cores and needs no data set download.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .evaluate import TaskResult, average_accuracy, evaluate_tasks, write_results
from .models import load_adapted_model, load_base_model
from .recipes import DataSpec, EvaluationSpec, MethodSpec, Recipe, TrainingSpec
from .synthetic import SYNTHETIC_TASKS, write_synthetic_data
from .training import TrainingOutcome, fine_tune

DEMO_TASKS = list(SYNTHETIC_TASKS)


@dataclass
class DemoReport:
    before: list[TaskResult]
    after: list[TaskResult]
    merged: list[TaskResult]
    training: TrainingOutcome
    seconds: float

    @property
    def merged_matches(self) -> bool:
        return all(
            a.response == m.response
            for after, merged in zip(self.after, self.merged, strict=True)
            for a, m in zip(after.predictions, merged.predictions, strict=True)
        )

    def table(self) -> str:
        rows = [f"{'task':<16} {'before':>8} {'after':>8} {'merged':>8}"]
        for before, after, merged in zip(self.before, self.after, self.merged, strict=True):
            rows.append(f"{before.task:<16} {before.accuracy:>8.1%} {after.accuracy:>8.1%} {merged.accuracy:>8.1%}")
        averages = (average_accuracy(results) for results in (self.before, self.after, self.merged))
        rows.append("{:<16} {:>8.1%} {:>8.1%} {:>8.1%}".format("average", *averages))
        return "\n".join(rows)


def demo_recipe(output_dir: Path, max_steps: int, k: int, learning_rate: float, test_size: int) -> Recipe:
    """NeuroAda on the mix of all generated tasks; k=1 wants a larger learning rate than LoRA (as in the paper)."""
    return Recipe(
        name="demo",
        output_dir=str(output_dir),
        model="default",
        method=MethodSpec(name="neuroada", k=k),
        data=DataSpec(dir=str(output_dir / "data"), train=["synthetic_mix"], max_length=128),
        training=TrainingSpec(
            learning_rate=learning_rate,
            batch_size=8,
            warmup=0.1,
            max_steps=max_steps,
            logging_steps=max(1, max_steps // 20),
            save_steps=max_steps,
        ),
        evaluation=EvaluationSpec(
            tasks=DEMO_TASKS, size=test_size, batch_size=32, max_new_tokens_options=12, max_new_tokens_number=24
        ),
    )


def run_demo(
    output_dir: str | Path = "outputs/neuroada-demo",
    max_steps: int = 80,
    train_size: int = 300,
    test_size: int = 40,
    k: int = 1,
    learning_rate: float = 1e-2,
) -> DemoReport:
    started = time.perf_counter()
    output_dir = Path(output_dir)
    write_synthetic_data(output_dir / "data", DEMO_TASKS, train_size=train_size, test_size=test_size)
    recipe = demo_recipe(output_dir, max_steps, k, learning_rate, test_size)

    def evaluate(model, tokenizer, name: str) -> list[TaskResult]:
        print(f"\n== Evaluating the {name} model on {test_size} generated test questions per task")
        results = evaluate_tasks(model, tokenizer, recipe.data.dir, recipe.evaluation)
        write_results(results, output_dir / f"results_{name}", {"model": name, "method": recipe.method.label})
        return results

    base, tokenizer = load_base_model(recipe.model)
    before = evaluate(base, tokenizer, "base")
    del base
    print(f"\n== Fine-tuning SmolLM2-135M-Instruct with NeuroAda k={k} for {max_steps} steps")
    training = fine_tune(recipe)
    after = evaluate(training.model, training.tokenizer, "trained")
    print(f"\n== Reloading the adapter from {recipe.adapter_dir} with PeftModel.from_pretrained and merging it")
    reloaded, tokenizer = load_adapted_model(recipe.model, recipe.adapter_dir)
    merged = evaluate(reloaded.merge_and_unload(), tokenizer, "merged")
    return DemoReport(before, after, merged, training, time.perf_counter() - started)


def print_report(report: DemoReport) -> None:
    training = report.training
    print("\n" + "=" * 60)
    print("NeuroAda demo: SmolLM2-135M-Instruct on generated tasks (accuracy)")
    print("=" * 60)
    print(report.table())
    print("-" * 60)
    print(
        f"trained {training.trainable_parameters:,} parameters for {training.steps} steps "
        f"in {training.seconds:.0f} s; loss {training.losses[0][1]:.3f} -> {training.losses[-1][1]:.3f}"
    )
    print(f"adapter saved in {training.adapter_dir}")
    verdict = "identical" if report.merged_matches else "DIFFERENT"
    print(f"reloaded + merged model answers: {verdict} to the trained model's")
    print(f"total time {report.seconds / 60:.1f} min")
