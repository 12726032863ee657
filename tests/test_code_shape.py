"""The tuner stays small enough to hold: a function a reader must take in at once fits on a screen, and the tuner
(`peft_neuroada/tuner/`, what peft would hold as `peft/tuners/neuroada`) is plain torch a peft reviewer can adopt."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "peft_neuroada"
TUNER = PACKAGE / "tuner"
MAX_FUNCTION_LINES = 50
# The core and its extensions together (the core alone, as peft's first patch holds it, is bounded at 900 lines by
# tests/test_peft_upstream_suite.py).
MAX_TUNER_LINES = 2000
# What peft's own tuners do not hold, and the tuner must not either (docs/design.md, "Layers").
FOREIGN_TO_A_PEFT_TUNER = {
    "threads or locks": r"\bimport threading\b|\bfrom threading\b|\bLock\(",
    "ctypes": r"\bctypes\b",
    "fork handlers": r"register_at_fork",
    "context variables": r"\bContextVar\b|\bcontextvars\b",
    "monkeypatching another module": r"^\s*[a-z_]+(\.[a-z_]+)+\.[A-Za-z_]+ = ",
    "private torch attributes": r"\._version\b|\._parameters\b|\._buffers\b|\._modules\b|_global_\w+_hooks",
    "process-global registrations": r"torch\.library|register_peft_method",
}


def test_no_function_of_the_package_core_is_longer_than_fifty_lines():
    core = [path for path in PACKAGE.rglob("*.py") if "train" not in path.relative_to(PACKAGE).parts]
    too_long = [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in core
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not too_long, too_long


def test_the_tuner_holds_nothing_a_peft_tuner_would_not():
    found = [
        f"{path.name}:{number}: {what}"
        for path in TUNER.glob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for what, pattern in FOREIGN_TO_A_PEFT_TUNER.items()
        if re.search(pattern, line)
    ]
    assert not found, found


def test_the_tuner_fits_in_an_afternoon_s_reading():
    assert sum(len(path.read_text().splitlines()) for path in TUNER.glob("*.py")) <= MAX_TUNER_LINES
