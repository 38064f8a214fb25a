"""benchmarks/bench_prompt_scores.py on CPU (--small: the tiny Qwen3, 3 sequences of 20-40 tokens):
each configuration runs its own engine in a child, every K prints a row, and
--output holds one results line per K. The sequences are seeded: the same ids for every config."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_prompt_scores")


def test_sequences_are_seeded_and_in_range(bench):
    a, b = bench.sequences(5, 3, 9, 50, seed=4), bench.sequences(5, 3, 9, 50, seed=4)
    assert a == b and a != bench.sequences(5, 3, 9, 50, seed=5)
    assert all(3 <= len(s) <= 9 and all(10 <= t < 50 for t in s) for s in a)


@pytest.mark.vllm
@pytest.mark.slow
def test_small_run_reports_every_k(bench, tmp_path, capsys):
    """One engine (vexact; stock and the ratio run on the GPU: a second CPU engine doubles the CI cost)."""
    out = tmp_path / "prompt_scores.jsonl"
    rc = bench.main(["--small", "--configs", "vexact", "--top-k", "0,2", "--output", str(out)])
    table = capsys.readouterr().out.splitlines()
    assert rc == 0
    rows = [line.split() for line in table[1:]]
    assert [(r[0], r[1], r[5]) for r in rows] == [("vexact", "0", "-"), ("vexact", "2", "-")]
    assert all(float(r[2]) > 0 for r in rows)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["prompt-scores-k0", "prompt-scores-k2"]
    assert all(r["value"].startswith("vexact ") and r["command"] for r in lines)
    child_log = (tmp_path / "prompt_scores.vexact.log").read_text()  # the child's whole output, kept
    assert child_log.count("RESULT ") == 2
