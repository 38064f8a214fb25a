"""benchmarks/bench_mla.py on CPU: its KV-bytes arithmetic is vLLM's own page accounting (our
per-head full-attention spec with a value head size, stock's MLA latent spec) on the published shapes,
the `cache` section writes its rows, and the GPU sections refuse to start without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_shapes import CONFIG_ONLY_SHAPES
from vexact_vllm.tiny_model import shape_config


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_mla")


@pytest.mark.parametrize("name", ["moonlight-16b-a3b-shape", "deepseek-v2-lite-shape"])
def test_bytes_per_token_are_vllms_page_sizes_on_the_published_shapes(bench, name):
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    config = DecoderConfig.from_hf(shape_config(*CONFIG_ONLY_SHAPES[name], special_id=0))
    mla, heads, layers = config.mla, config.num_heads, config.num_layers
    ours, latent = bench.kv_bytes_per_token(
        heads, layers, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    )
    page = 16
    spec = FullAttentionSpec(
        block_size=page, num_kv_heads=heads, head_size=config.head_dim, head_size_v=config.value_head_dim,
        dtype=torch.bfloat16,
    )  # fmt: skip
    stock = MLAAttentionSpec(
        block_size=page,
        num_kv_heads=1,
        head_size=mla.kv_lora_rank + mla.qk_rope_head_dim,
        dtype=torch.bfloat16,
    )
    assert ours == spec.page_size_bytes // page * layers == 276_480  # 270 KiB
    assert latent == stock.page_size_bytes // page * layers == 31_104  # 30.4 KiB
    assert bench.PUBLISHED["Moonlight-16B-A3B"] == bench.PUBLISHED["DeepSeek-V2-Lite"] == (heads, layers)


def test_cache_section_rows(bench, tmp_path, capsys):
    assert bench.main(["--only", "cache", "--out", str(tmp_path)]) == 0
    rows = {r["case"]: r for r in json.loads((tmp_path / "mla.json").read_text())["rows"]}
    assert list(rows) == list(bench.PUBLISHED)
    assert rows["DeepSeek-V3/R1"]["vexact_bytes"] == 128 * 320 * 2 * 61 == 4_997_120  # 4.77 MiB
    assert rows["DeepSeek-V3/R1"]["stock_bytes"] == 576 * 2 * 61 == 70_272  # 68.6 KiB
    assert round(rows["DeepSeek-V3/R1"]["ratio"], 1) == 71.1 and round(rows["Kimi-K2"]["ratio"], 1) == 35.6
    assert round(rows["Moonlight-16B-A3B"]["ratio"], 2) == 8.89
    assert "71.1x" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_gpu_sections_need_cuda(bench, tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--only", "cache,decode", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--only", "latent"])
