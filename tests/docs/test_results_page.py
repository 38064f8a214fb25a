"""docs/results.md is the page scripts/results_page.py makes from docs/results.jsonl, and the data is
well formed: every row has the required fields, a unique slug id, a date and a commit."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_page_equals_generated(results_page):
    page = results_page.render(results_page.load_rows(results_page.DATA))
    assert (ROOT / "docs" / "results.md").read_text() == page, "run: python scripts/results_page.py"
    assert results_page.main(["--check"]) == 0


def test_rows_are_well_formed(results_page):
    rows = results_page.load_rows(results_page.DATA)
    assert len(rows) >= 20
    for row in rows:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|published", row["date"]), row["id"]
        commits = [c.strip() for c in row["commit"].split(",")]
        assert all(re.fullmatch(r"[0-9a-f]{7,40}|-", c) for c in commits), row["id"]


def test_every_row_has_its_anchor(results_page):
    page = (ROOT / "docs" / "results.md").read_text()
    anchors = {results_page.github_anchor(line.lstrip("#")) for line in page.splitlines() if line.startswith("#")}
    for row in results_page.load_rows(results_page.DATA):
        assert row["id"] in anchors


@pytest.mark.parametrize(
    "line, message",
    [
        ({"id": "a"}, "missing"),
        ({"id": "Bad Id", "section": "s", "title": "t", "date": "d", "device": "x", "commit": "-",
          "command": "c", "metric": "m", "value": "v"}, "slug"),
        ({"id": "a", "section": "s", "title": "t", "date": "d", "device": "x", "commit": "-",
          "command": "c", "metric": "m", "value": "v", "colour": "red"}, "unknown"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused(results_page, tmp_path, line, message):
    data = tmp_path / "results.jsonl"
    data.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=message):
        results_page.load_rows(data)


def test_duplicate_ids_are_refused(results_page, tmp_path):
    row = {"id": "a", "section": "s", "title": "t", "date": "d", "device": "x", "commit": "-", "command": "c",
           "metric": "m", "value": "v"}  # fmt: skip
    data = tmp_path / "results.jsonl"
    data.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="twice"):
        results_page.load_rows(data)
