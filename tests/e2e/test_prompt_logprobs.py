"""`vexact-vllm check --prompt-logprobs K` end to end: every prompt token vLLM scores (its log-prob,
the top K and the ranks) equals the trainer's at temperature 1, in the compositions where prompts are
scored under different schedules (batched, chunked prefill, preemption, beside prefix-cache hits)."""

from __future__ import annotations

import json

import pytest

from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COMPOSITIONS = ("batch", "chunked-prefill", "preemption", "prefix-cache")


def test_prompt_logprobs_equal_the_trainers_in_every_composition(tiny_model, tmp_path):
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", tiny_model("qwen3"), "--num-prompts", "4", "--max-tokens", "6",
        "--compositions", ",".join(COMPOSITIONS), "--prompt-logprobs", "2", "--micro-batches", "1,0",
        "--json", "--output", str(out), "--quiet",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"] is True, report
    assert report["prompt_logprobs"] == 2
    prompt_rows = [r for r in report["rows"] if "prompt log-probs (top 2)" in r["composition"]]
    sampled_rows = [r for r in report["rows"] if r not in prompt_rows]
    assert sorted(r["composition"].split(" ")[0] for r in sampled_rows) == sorted(COMPOSITIONS)
    assert len(prompt_rows) == len(COMPOSITIONS)
    for row in prompt_rows:
        # every request but prefix-cache's continued ones asks: at least 4 prompts of >= 2 tokens each
        assert row["tokens"] >= 4 and row["mismatches"] == 0, row
