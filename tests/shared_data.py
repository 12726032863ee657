"""Where the paper's data sets live for the tests: ../shared/datasets beside the checkout (CI has it there)."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATASETS = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


def shared_datasets() -> Path:
    if not (SHARED_DATASETS / "commonsense_15k" / "train.json").is_file():
        pytest.skip(f"the LLM-Adapters data sets are not in {SHARED_DATASETS}")
    return SHARED_DATASETS
