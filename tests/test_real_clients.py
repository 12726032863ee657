"""Clients that load adapters for the user, run in fresh processes as users start them, never import peft_neuroada:
the installed start-up hook (`peft_neuroada.pth` -> `peft_neuroada_autoload`) must register NEUROADA whatever the
client does before importing peft. transformers' `is_peft_available()` (`importlib.util.find_spec("peft")`) asks for
peft before importing it; a hook that answered only the first question left the real import unwrapped, and
lm-evaluation-harness, transformers' adapter loading and TRL scripts ended in `KeyError: 'NEUROADA'`."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from peft_neuroada import NeuroAdaConfig
from tests.conftest import logits, save_tiny_llama, tiny_causal_lm, tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not any((Path(directory) / "peft_neuroada.pth").exists() for directory in site.getsitepackages()),
    reason="peft-neuroada is not pip-installed, so its start-up hook is absent",
)


def run_client(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process: offline, its own HF_HOME, never told to import peft_neuroada.

    The installed `peft_neuroada.pth` runs `import peft_neuroada_autoload` at start-up; the checkout's root comes first
    on PYTHONPATH so that import (and `peft_neuroada`) resolve to this checkout, not to a copy an install left behind.
    """
    env = {key: value for key, value in os.environ.items() if key != "PEFT_NEUROADA_NO_AUTOLOAD"}
    env |= {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(cwd / "hf_home"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def last_json_line(done: subprocess.CompletedProcess):
    return json.loads(done.stdout.strip().splitlines()[-1])


REPRODUCTION = (
    "import importlib.util; importlib.util.find_spec('peft'); "
    "from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING as M; print('NEUROADA' in M)"
)

# Every way a client asks about peft before importing it, then a threaded import; one process.
PROBES_THEN_THREADS = """
import importlib, importlib.metadata, importlib.util, json, pkgutil, sys, threading
import peft_neuroada_autoload

def finders():
    return sum(getattr(type(f), "_peft_neuroada_autoload", False) for f in sys.meta_path)

seen = {"finders at start": finders()}
importlib.reload(peft_neuroada_autoload)
seen["finders after reload"] = finders()
importlib.util.find_spec("peft")
importlib.util.find_spec("peft")
from transformers.utils import is_peft_available
seen["is_peft_available"] = is_peft_available()
importlib.metadata.version("peft")
importlib.metadata.distribution("peft")
seen["pkgutil finds peft"] = any(module.name == "peft" for module in pkgutil.iter_modules())
seen["peft imported by the probes"] = "peft" in sys.modules
seen["finders after the probes"] = finders()
registered = []
go = threading.Barrier(4)

def use_peft():
    go.wait()
    peft = importlib.import_module("peft")
    registered.append("NEUROADA" in peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING)

threads = [threading.Thread(target=use_peft) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
import peft
seen["registered in each thread"] = registered
seen["finders after the import"] = finders()
seen["peft's loader is its own again"] = "exec_module" not in vars(peft.__loader__)
print(json.dumps(seen))
"""


def test_the_one_line_reproduction_finds_neuroada_after_peft_was_looked_up(tmp_path):
    assert run_client(["-c", REPRODUCTION], tmp_path).stdout.strip() == "True"


def test_probes_reload_and_threads_leave_one_finder_until_peft_runs_then_none(tmp_path):
    seen = last_json_line(run_client(["-c", PROBES_THEN_THREADS], tmp_path))
    assert seen == {
        "finders at start": 1,
        "finders after reload": 1,
        "is_peft_available": True,
        "pkgutil finds peft": True,
        "peft imported by the probes": False,
        "finders after the probes": 1,
        "registered in each thread": [True] * 4,
        "finders after the import": 0,
        "peft's loader is its own again": True,
    }


TRANSFORMERS_LOADING = """
import sys, torch
from transformers import AutoModelForCausalLM
base, adapter, tokens, out = sys.argv[1:]
tokens = torch.load(tokens)
by_folder = AutoModelForCausalLM.from_pretrained(adapter).eval()  # the adapter's config names the base folder
by_method = AutoModelForCausalLM.from_pretrained(base).eval()
by_method.load_adapter(adapter)
with torch.no_grad():
    torch.save({"from_pretrained": by_folder(tokens).logits, "load_adapter": by_method(tokens).logits}, out)
"""


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])  # a MoE model's experts adapted as 3-D parameters too
def test_transformers_loads_an_adapter_in_a_process_that_never_imports_the_plugin(tmp_path, model):
    base = tmp_path / "base"
    (tiny_llama() if model == "llama" else tiny_causal_lm(model)).save_pretrained(base)
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), NeuroAdaConfig(k=2, init_weights=False)
    ).save_pretrained(tmp_path / "adapter")
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    expected = logits(
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"), tokens
    )
    assert not torch.equal(expected, logits(AutoModelForCausalLM.from_pretrained(base), tokens))
    paths = [tmp_path / name for name in ("base", "adapter", "tokens.pt", "loaded.pt")]
    run_client(["-c", TRANSFORMERS_LOADING, *map(str, paths)], tmp_path)
    loaded = torch.load(tmp_path / "loaded.pt")
    assert torch.equal(loaded["from_pretrained"], expected)
    assert torch.equal(loaded["load_adapter"], expected)


@pytest.fixture(scope="module")
def tiny_with_adapter(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama with SmolLM2's tokenizer, an untrained NeuroAda adapter on it (random deltas, k=1), and the
    adapter merged into a copy of the base, each saved as a local folder."""
    root = tmp_path_factory.mktemp("tiny_with_adapter")
    base = save_tiny_llama(root / "base", smollm2_tokenizer)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), NeuroAdaConfig(k=1, init_weights=False))
    model.save_pretrained(root / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(root / "merged")
    smollm2_tokenizer.save_pretrained(root / "merged")
    # The deltas move the log-probabilities lm-evaluation-harness scores far more than SCORE_TOLERANCE, so scores of
    # the adapter that match the merged model's cannot be the base model's.
    tokens = smollm2_tokenizer([f"Question: {QUESTIONS[0][0]}\nAnswer: blue"], return_tensors="pt")["input_ids"]
    merged_scores = logits(merged, tokens).log_softmax(-1)
    base_scores = logits(AutoModelForCausalLM.from_pretrained(base), tokens).log_softmax(-1)
    assert (merged_scores - base_scores).abs().max() > 100 * SCORE_TOLERANCE["atol"]
    return root


SCORE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}  # the two runs' log-likelihoods (bit-equal on the CPU today)


QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("Which animal barks?", ["cat", "cow", "bird", "dog"], 3),
    ("What is frozen water called?", ["ice", "steam", "sand", "glass"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do you use to write on paper?", ["spoon", "shoe", "pencil", "plate"], 2),
    ("Which season is the coldest?", ["summer", "spring", "autumn", "winter"], 3),
    ("What is the opposite of hot?", ["cold", "tall", "loud", "fast"], 0),
    ("Where do fish live?", ["trees", "water", "clouds", "deserts"], 1),
    ("What do cows drink?", ["oil", "juice", "water", "coffee"], 2),
    ("Which shape has three sides?", ["circle", "square", "oval", "triangle"], 3),
    ("What does a clock show?", ["time", "weight", "color", "smell"], 0),
    ("Which fruit is yellow and long?", ["apple", "banana", "grape", "cherry"], 1),
    ("What do we breathe?", ["water", "sand", "air", "stone"], 2),
    ("How many days are in a week?", ["five", "six", "eight", "seven"], 3),
    ("What gives us light during the day?", ["the sun", "the moon", "a lamp", "a star"], 0),
    ("Which animal says moo?", ["duck", "cow", "sheep", "horse"], 1),
    ("What do you sleep in?", ["a car", "a box", "a bed", "a cup"], 2),
    ("Which is a vegetable?", ["cake", "bread", "candy", "carrot"], 3),
    ("What is two plus two?", ["four", "three", "five", "six"], 0),
    ("Which is the largest ocean?", ["Atlantic", "Pacific", "Indian", "Arctic"], 1),
    ("What do plants need to grow?", ["plastic", "metal", "sunlight", "glass"], 2),
    ("Which animal can fly?", ["fish", "dog", "snake", "bird"], 3),
    ("What is the color of grass?", ["green", "purple", "orange", "white"], 0),
    ("Where does bread come from?", ["a mine", "a bakery", "a river", "a cloud"], 1),
    ("Which month comes after January?", ["March", "December", "February", "April"], 2),
    ("What do you wear on your feet?", ["hats", "gloves", "scarves", "shoes"], 3),
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("How many hours are in a day?", ["twelve", "twenty-four", "sixty", "seven"], 1),
    ("Which is a musical instrument?", ["fork", "chair", "piano", "lamp"], 2),
    ("What is the opposite of up?", ["left", "right", "over", "down"], 3),
]

TASK_YAML = """task: neuroada_questions
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def lm_eval(model_args: str, tasks: Path, out: Path, cwd: Path) -> tuple[dict, list[dict]]:
    """docs/guide.md's command line of lm-evaluation-harness; returns the task's results and its logged samples."""
    run_client(
        [
            "-m", "lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", "neuroada_questions",
            "--include_path", str(tasks), "--device", "cpu", "--batch_size", "4", "--output_path", str(out),
            "--log_samples",
        ],
        cwd,
        timeout=600,
    )  # fmt: skip
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_neuroada_questions_*.jsonl")
    logged = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])
    return json.loads(results.read_text())["results"]["neuroada_questions"], logged


def test_lm_evaluation_harness_scores_an_adapter_as_its_merged_model(tmp_path, tiny_with_adapter):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"question": q, "choices": choices, "answer": answer} for q, choices, answer in QUESTIONS]
    (tasks / "questions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tasks / "neuroada_questions.yaml").write_text(TASK_YAML.format(data=json.dumps(str(tasks / "questions.jsonl"))))
    base, adapter, merged = (tiny_with_adapter / name for name in ("base", "adapter", "merged"))
    by_adapter, adapter_samples = lm_eval(
        f"pretrained={base},peft={adapter}", tasks, tmp_path / "by_adapter", tmp_path
    )
    by_merged, merged_samples = lm_eval(f"pretrained={merged}", tasks, tmp_path / "by_merged", tmp_path)

    assert len(adapter_samples) == len(merged_samples) == len(QUESTIONS)
    for metric in ("acc,none", "acc_norm,none"):
        assert by_adapter[metric] == by_merged[metric], (metric, by_adapter, by_merged)
    scores = {
        name: torch.tensor([[float(score) for score, _ in sample["filtered_resps"]] for sample in samples])
        for name, samples in (("adapter", adapter_samples), ("merged", merged_samples))
    }
    torch.testing.assert_close(scores["adapter"], scores["merged"], **SCORE_TOLERANCE)


TRL_CONTINUES_AN_ADAPTER = """
import sys
from trl import SFTConfig, SFTTrainer  # TRL imports transformers, which looks peft up, and then peft
import datasets
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
base, adapter, out = sys.argv[1:]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter, is_trainable=True)
texts = datasets.Dataset.from_list([{"text": f"{i} plus {i} is {2 * i}."} for i in range(8)])
args = SFTConfig(
    output_dir=out, use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
    max_length=32, report_to=[], save_strategy="no",
)
trainer = SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=AutoTokenizer.from_pretrained(base))
trainer.train()
trainer.save_model(out)
"""


def test_a_trl_script_continues_training_a_saved_adapter_without_importing_the_plugin(tmp_path, tiny_with_adapter):
    """TRL has no loader of its own for a saved adapter (`SFTTrainer(model=path)` reads the folder's config.json, which
    an adapter folder lacks): a script loads it with peft after importing TRL, and trains it on."""
    from safetensors.torch import load_file

    adapter, continued = tiny_with_adapter / "adapter", tmp_path / "continued"
    run_client(
        ["-c", TRL_CONTINUES_AN_ADAPTER, str(tiny_with_adapter / "base"), str(adapter), str(continued)], tmp_path
    )
    before = load_file(adapter / "adapter_model.safetensors")
    after = load_file(continued / "adapter_model.safetensors")
    assert json.loads((continued / "adapter_config.json").read_text())["peft_type"] == "NEUROADA"
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        if key.endswith("neuroada_indices"):
            assert torch.equal(after[key], tensor), key
    deltas = [key for key in before if key.endswith("neuroada_delta")]
    assert deltas and all(not torch.equal(after[key], before[key]) for key in deltas)
