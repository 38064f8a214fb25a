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


def test_chart_draws_the_throughput_ratios(results_page):
    """The chart's rows: vexact / stock ratios per shape, workload and device, and none of the other
    figures (kernel speeds, settings experiments, baselines)."""
    rows = results_page.load_rows(results_page.DATA)
    points = {p.id: p for p in results_page.chart_points(rows)}
    throughput = {r["id"] for r in rows if r["id"].startswith(("tp1-", "tp2-"))}
    assert throughput and throughput <= set(points) and "moe-30b-a3b-h200" in points
    assert not {"moe-kernels-h200", "fa4-engine", "shared-prefix", "baseline-stock-h100"} & set(points)
    by_id = {r["id"]: r for r in rows}
    for p in points.values():
        assert by_id[p.id]["value"].startswith(f"{p.value:g}x") or by_id[p.id]["value"].startswith(f"{p.value}x")
        assert p.device in ("H100", "H200") and p.device in p.label


@pytest.mark.parametrize(
    "spread, runs",
    [
        ("pairs 0.821 1.021 1.193 1.075 0.995 (5 pairs, 2 runs)", [0.821, 1.021, 1.193, 1.075, 0.995]),
        ("runs 1.060 1.041 1.042 0.923", [1.060, 1.041, 1.042, 0.923]),
        ("one run, no spread", []),
        (None, []),
        ("vexact 13,567 tok/s (spread 0.1%), stock 20,320 (spread 0.9%)", []),
        ("launches 0.968 (stock first) and 0.947 (vexact first); vexact 8,356 tok/s (spread 0.5%), stock 8,727 (1.7%)",
         [0.968, 0.947]),
    ],
)  # fmt: skip
def test_run_ratios(results_page, spread, runs):
    assert results_page.run_ratios(spread) == runs


def test_a_chart_drawn_from_other_data_is_out_of_date(results_page, tmp_path):
    """The committed chart carries the digest of what it draws (read without matplotlib); changing a
    figure changes the digest, so --check would ask for the chart to be drawn again."""
    points = results_page.chart_points(results_page.load_rows(results_page.DATA))
    assert results_page.chart_is_current(points, results_page.CHART)
    assert results_page.png_texts(results_page.CHART)["Description"].endswith(results_page.chart_digest(points))
    changed = [points[0]._replace(value=points[0].value + 0.001), *points[1:]]
    assert not results_page.chart_is_current(changed, results_page.CHART)
    assert not results_page.chart_is_current(points, tmp_path / "missing.png")
    assert f"({results_page.CHART_LINK})" in (ROOT / "docs" / "results.md").read_text()
