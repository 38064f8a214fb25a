"""benchmarks/bench_prompt_scores.py: the sequences are seeded and in range, the parent's table and
JSON lines come from its children's RESULT lines (vexact over stock per k), and a CPU smoke run on
the tiny Qwen3 scores every prompt token with prompt_logprobs 0 and 2."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest


def test_sequences_are_seeded_and_in_range(load_script):
    bench = load_script("bench_prompt_scores")
    seqs = bench.sequences(50, 3, 9, 40, seed=5)
    assert seqs == bench.sequences(50, 3, 9, 40, seed=5) != bench.sequences(50, 3, 9, 40, seed=6)
    assert all(3 <= len(s) <= 9 and all(10 <= t < 40 for t in s) for s in seqs)
    assert {len(s) for s in seqs} == set(range(3, 10))


def test_the_table_and_results_come_from_the_children(load_script, monkeypatch, tmp_path, capsys):
    bench = load_script("bench_prompt_scores")
    rates = {("stock", 0): 400.0, ("vexact", 0): 300.0, ("stock", 5): 200.0, ("vexact", 5): 100.0}
    children = []

    def fake_run(cmd, **kwargs):
        if cmd[0] == "git":
            return SimpleNamespace(stdout="abc1234\n", returncode=0)
        config = cmd[cmd.index("--config") + 1]
        children.append(cmd)
        lines = [
            "RESULT " + json.dumps({"config": config, "top_k": k, "scored_tokens": 9, "passes": 2,
                                    "tok_s": rates[config, k], "min": 1.0, "max": 2.0})
            for k in (0, 5)
        ]  # fmt: skip
        return SimpleNamespace(stdout="noise\n" + "\n".join(lines) + "\n", stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "r.jsonl"
    assert bench.main(["--model", "qwen3-8b-shape", "--output", str(out)]) == 0
    assert [c[c.index("--config") + 1] for c in children] == ["stock", "vexact"]
    table = capsys.readouterr().out
    assert "0.750" in table and "0.500" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["prompt-scores-k0", "prompt-scores-k5"]
    assert rows[0]["value"] == "stock 400, vexact 300 (0.750x stock)"
    assert rows[1]["value"] == "stock 200, vexact 100 (0.500x stock)" and rows[1]["commit"] == "abc1234"

    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: SimpleNamespace(stdout="", stderr="boom", returncode=1)
    )
    with pytest.raises(SystemExit, match="stock: the run failed"):
        bench.main([])


@pytest.mark.vllm
@pytest.mark.slow
def test_small_run_scores_every_prompt_token(load_script, tmp_path, capsys):
    """One vexact engine on the tiny Qwen3 (the child asserts one prompt entry per token)."""
    bench = load_script("bench_prompt_scores")
    out = tmp_path / "r.jsonl"
    assert bench.main(["--small", "--configs", "vexact", "--top-k", "0,2", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["prompt-scores-k0", "prompt-scores-k2"]
    assert all(r["value"].startswith("vexact ") and float(r["value"].split()[1]) > 0 for r in rows)
