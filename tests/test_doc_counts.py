"""Counts that describe code are written by the script that builds the patch, or checked by a spec, so that no page
states a stale one: docs/upstream.md's marked blocks (the patch's lines and files, the tuner model's overrides) and
docs/design.md's (the tuner's size, by file and by feature) are what benchmarks/upstream_patch.py writes for the
committed patch and tuner, and no other page repeats the patch's counts. (Whether the committed patch is today's,
and the counts of peft's test cases, are tests/test_peft_upstream_suite.py's.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from peft_neuroada.tuner.model import NeuroAdaModel

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_DOC = ROOT / "docs" / "upstream.md"
# What a page would say if it repeated a count of upstream.md's blocks or of its peft test run.
REPEATED_COUNTS = r"\b\d[\d,]* added lines|\b\d+ (?:BaseTuner )?overrides|\b\d[\d,]* NeuroAda cases"


def test_upstream_md_s_counts_are_those_of_the_committed_patch_and_tuner(upstream_patch, peft_release):
    release = upstream_patch.Release(peft_release)
    for page in (UPSTREAM_DOC, upstream_patch.ISSUE_DOC, upstream_patch.DESIGN_DOC):
        doc = page.read_text()
        assert upstream_patch.with_counts(doc, upstream_patch.PATCH.read_text(), release) == doc, (
            f"stale {page.name}: run `python benchmarks/upstream_patch.py`"
        )
    assert "<!-- counts:sizes -->" in upstream_patch.ISSUE_DOC.read_text()
    assert "<!-- counts:tuner -->" in upstream_patch.DESIGN_DOC.read_text()
    assert "<!-- counts:features -->" in upstream_patch.DESIGN_DOC.read_text()


def test_the_feature_table_refuses_a_definition_the_tuner_no_longer_has(upstream_patch):
    source = (upstream_patch.TUNER / "layer.py").read_text()
    assert upstream_patch.definition_lines(source, "Linear._mixed_batch_forward")
    with pytest.raises(ValueError, match="does not define once"):
        upstream_patch.definition_lines(source, "Linear._renamed_mixed_batch_forward")


def test_the_override_table_gives_a_reason_for_every_override(upstream_patch):
    after_block = UPSTREAM_DOC.read_text().split("<!-- /counts:overrides -->", 1)[1]
    table = after_block.strip().split("\n\n", 1)[0]
    named = re.findall(r"(?m)^\| `(\w+)` \|", table)
    assert sorted(named) == sorted(upstream_patch.tuner_overrides(NeuroAdaModel))


def test_the_alternative_is_under_a_quarter_of_the_patch(upstream_patch):
    """upstream.md: the alternative pull request "is under a quarter of the size" of this one."""
    doc = " ".join(UPSTREAM_DOC.read_text().split())
    assert "under a quarter of the size" in doc
    alternative = int(re.search(r"for every Super-Tuning adapter \| (\d+) \(built", doc)[1])
    assert 4 * alternative < upstream_patch.patch_counts(upstream_patch.PATCH.read_text())["added"]


def test_no_other_page_repeats_the_counts():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    repeated = {
        page.relative_to(ROOT).as_posix(): re.findall(REPEATED_COUNTS, " ".join(page.read_text().split()))
        for page in pages
        if page != UPSTREAM_DOC
    }
    assert not {page: found for page, found in repeated.items() if found}, "link to docs/upstream.md instead"


def test_the_prs_docs_page_has_the_shape_of_super_tuning_s():
    """As peft's Super-Tuning page: the paper's link, a summary and the constraints, the paper's abstract, usage and
    the autodoc of the config and the model; no measured tables (those are this project's, on its hardware)."""
    page = (ROOT / "docs" / "upstream" / "pr" / "docs" / "source" / "package_reference" / "neuroada.md").read_text()
    headings = re.findall(r"(?m)^#+ (.+)$", page)
    assert headings == ["NeuroAda", "Usage", "NeuroAdaConfig", "NeuroAdaModel"]
    assert "[NeuroAda](https://arxiv.org/abs/2510.18940)" in page and "The abstract from the paper is:" in page
    assert "[[autodoc]] tuners.neuroada.config.NeuroAdaConfig" in page
    assert "[[autodoc]] tuners.neuroada.model.NeuroAdaModel" in page
    assert not re.search(r"(?m)^\|", page)
