"""The tuner stays small enough to hold: a function a reader must take in at once fits on a screen."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "peft_neuroada"
MAX_FUNCTION_LINES = 50


def test_no_function_of_the_tuner_is_longer_than_fifty_lines():
    core = [*PACKAGE.glob("*.py"), *(PACKAGE / "kernels").glob("*.py")]
    too_long = [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in core
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not too_long, too_long
