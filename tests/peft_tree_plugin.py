"""A pytest plugin for peft's own tests, run in the patched copy of peft's source tree by
tests/test_peft_upstream_suite.py (copied there, never imported by this project's suite).

peft's tests fetch tiny models from the Hub, and go online on the first access to each model id even when offline.
The spec builds local stand-ins for them (same architecture and class, built from a config) into the local Hub cache;
this plugin tells peft's helper that those it serves were fetched already, leaves out the cases whose Hub model is not
served or that read a Hub repository, and reports which peft ran.
"""

import json
import os
import sys
from pathlib import Path

import pytest

STAND_INS = json.loads(os.environ["NEUROADA_STAND_INS"])  # Hub model ids served from HF_HUB_CACHE
HUB_ONLY = set(json.loads(os.environ["NEUROADA_HUB_ONLY"]))  # tests (ids without parameters) reading a Hub repository
REPORT = Path(os.environ["NEUROADA_REPORT"])


def pytest_configure(config):
    from tests import testing_utils

    testing_utils._HUB_MODEL_ACCESSES.update(dict.fromkeys(STAND_INS, 1))


def needs_the_hub(item) -> bool:
    """A test that reads a Hub repository, or runs on a Hub model (an id "owner/name") without a stand-in."""
    model_id = getattr(item, "callspec", None) and item.callspec.params.get("model_id")
    on_hub_model = isinstance(model_id, str) and "/" in model_id and model_id not in STAND_INS
    return on_hub_model or item.nodeid.split("[")[0] in HUB_ONLY


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Leave out the cases that need the Hub (before `-k` selects)."""
    offline = [item for item in items if needs_the_hub(item)]
    items[:] = [item for item in items if not needs_the_hub(item)]
    config.hook.pytest_deselected(items=offline)


def pytest_sessionfinish(session):
    import peft

    report = {
        "peft": peft.__file__,
        "NeuroAdaConfig": getattr(peft, "NeuroAdaConfig", type(None)).__module__,
        "plugin_imported": any(name.split(".")[0] == "peft_neuroada" for name in sys.modules),
    }
    REPORT.write_text(json.dumps(report))
