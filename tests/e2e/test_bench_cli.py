"""`vexact-vllm bench` runs each configuration in its own process and reports output tokens/s."""

from __future__ import annotations

import json

import pytest

from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_reports_throughput(tiny_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", tiny_model("qwen3"), "--configs", "vexact", "--num-prompts", "4",
        "--input-len", "8-20", "--output-len", "6", "--output", str(out),
        "--engine-kwargs", json.dumps({"kv_cache_memory_bytes": 64 << 20, "block_size": 32}),
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["config"] == "vexact"
    assert result["output_tokens"] == 4 * 6
    assert result["output_tok_s"] > 0 and result["startup_s"] > 0
    assert "vexact" in capsys.readouterr().out


def test_bench_refuses_unknown_configuration(tiny_model):
    with pytest.raises(SystemExit, match="unknown configuration"):
        main(["bench", "--model", tiny_model("qwen3"), "--configs", "fastest"])
