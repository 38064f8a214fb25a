"""benchmarks/bench_trainer.py's DeepSeek shapes: moonlight-4l (Moonlight-16B-A3B with 4 of its 27 layers,
for the GPU) builds our DecoderConfig with Moonlight's sizes, and tiny-deepseek runs one CPU step per path
against transformers' DeepseekV3ForCausalLM with the same seeded weights."""

from __future__ import annotations

import json

import pytest
import torch

from vexact_vllm.model_patches.config import DecoderConfig


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_trainer")


def test_moonlight_layers_shape(bench):
    config = DecoderConfig.from_hf(bench.shape_config(*bench.SHAPES["moonlight-4l"], special_id=0))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.head_dim) == (4, 2048, 16, 192)
    assert (config.mla.v_head_dim, config.mla.kv_lora_rank, config.mla.q_lora_rank) == (128, 512, None)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.sparse_layers) == (64, 6, (1, 2, 3))


def test_tiny_deepseek_same_loss_as_transformers(bench, tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path / "trainer.json"
    try:
        rc = bench.main([
            "--shape", "tiny-deepseek", "--device", "cpu", "--batch", "2", "--seq-len", "48", "--steps", "1",
            "--warmup", "0", "--stock", "sdpa-packed", "--init-std", "0.3", "--no-logits-check", "--json", str(out),
        ])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, capsys.readouterr().out
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["vexact", "stock-sdpa-packed"]
    assert rows["stock-sdpa-packed"]["experts"] in ("eager", "grouped_mm")  # transformers' DeepSeek MoE
    # At std 0.3 the loss is far from log(V) = 6.93, so weights that differ between the two classes (a
    # name missed by the seeded init) would show; the rest is bf16 rounding (5.5e-4 relative measured).
    assert rows["vexact"]["loss"] > 9
    assert rows["stock-sdpa-packed"]["loss"] == pytest.approx(rows["vexact"]["loss"], rel=2e-3)
