"""The tuner (`peft_neuroada/tuner/`, what peft would hold as `peft/tuners/neuroada`) is plain torch a peft reviewer
can adopt. Its sizes are measured and generated into docs/upstream.md, not walls here."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "peft_neuroada"
TUNER = PACKAGE / "tuner"
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


def test_the_tuner_holds_nothing_a_peft_tuner_would_not():
    found = [
        f"{path.name}:{number}: {what}"
        for path in TUNER.glob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for what, pattern in FOREIGN_TO_A_PEFT_TUNER.items()
        if re.search(pattern, line)
    ]
    assert not found, found
