"""Attention at DeepSeek's MLA head sizes on one GPU: vexact's kernels (K and V decompressed per head,
q/k 192 = 128 + 64, v 128) against what stock vLLM runs on Hopper, prefill and decode; and what each KV
cache holds per token.

    python benchmarks/bench_mla.py [--out DIR] [--quick] [--only prefill,decode,train] [--heads 16]

Sections (16 heads by default: Moonlight-16B-A3B and DeepSeek-V2-Lite at TP=1, DeepSeek-V3 at TP=8):
- cache: KV bytes per token of vexact's cache (K at qk_nope + qk_rope, V at v_head_dim, per head and layer)
  against stock's latent (kv_lora_rank + qk_rope_head_dim per layer), bf16, for the published shapes;
  the only section that runs without a GPU (`--only cache`).
- prefill: varlen causal attention at 192/128: ours (`varlen_attention`, the training kernel) against
  FlashAttention-3 at the same head sizes (`vllm.vllm_flash_attn`, fa_version=3: vLLM's MLA prefill on
  SM90 runs it without padding V).
- decode: one query per sequence over `context` keys. ours: `paged_attention` over vLLM's per-head cache
  ([blocks, Hkv, 16, D + Dv], 16-token pages, scattered); stock-fa3: FA3's paged decode over the same
  per-head K/V (kernel against kernel at equal work); fa3-mla: FlashAttention-3 over the 576-wide latent
  cache, stock vLLM's decode on SM90 (its FLASH_ATTN_MLA backend, first in vLLM 0.26's order there:
  the rotary 64 as q/k, the 512 latent as v, q_nope as q_v); flashmla: FlashMLA over the same latent
  (64-token pages), the next backend. Both absorbed forms: the per-head q absorption and W_UV
  up-projection GEMMs around them are not timed, so the ratios favour stock.
- train: ours forward+backward at 192/128 against torch SDPA's (vLLM's FlashAttention has no backward).
"speed" is stock time / vexact time. Medians of CUDA-event timings (triton.testing.do_bench); decode
under a CUDA graph (vLLM replays graphs at decode). Every number goes to DIR/mla.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from bench_env import sections

ROWS: list[dict] = []
section = sections(ROWS)  # a failing section records an ERROR row; the next ones run
DEVICE = "cuda"  # the CPU test runs the sections' plumbing on "cpu" with stand-in stock kernels
PREFILL_CASES = [(16, 1024), (4, 4096), (1, 16384)]  # (sequences, tokens each)
TRAIN_CASES = [(8, 1024), (2, 8192)]
DECODE_CASES = [(256, 1024), (64, 8192), (16, 32768)]  # (sequences, keys each)
D_NOPE, D_ROPE, D_V, LATENT = 128, 64, 128, 512  # every published DeepSeek-V2/V3-architecture model
# name: (attention heads, layers) of the published configs; the head sizes above are theirs.
PUBLISHED = {
    "Moonlight-16B-A3B": (16, 27),
    "DeepSeek-V2-Lite": (16, 27),
    "DeepSeek-V3/R1": (128, 61),
    "Kimi-K2": (64, 61),
}


def kv_bytes_per_token(
    heads: int,
    layers: int,
    qk_nope: int = D_NOPE,
    qk_rope: int = D_ROPE,
    v: int = D_V,
    kv_lora_rank: int = LATENT,
    itemsize: int = 2,
) -> tuple[int, int]:
    """(vexact's, stock's latent) KV cache bytes per token: K (qk_nope + qk_rope) and V (v) for every head
    of every layer, against one kv_lora_rank + qk_rope latent per layer."""
    return heads * (qk_nope + qk_rope + v) * layers * itemsize, (kv_lora_rank + qk_rope) * layers * itemsize


def record(section, case, ours_ms, stock_ms, stock="", **extra):
    speed = stock_ms / ours_ms if ours_ms and stock_ms else float("nan")
    ROWS.append({"section": section, "case": case, "stock": stock, "vexact_ms": ours_ms, "stock_ms": stock_ms,
                 "speed": speed, **extra})  # fmt: skip
    print(f"{section:8s} {case:34s} vexact {ours_ms:9.4f} ms  {stock or 'stock':14s} {stock_ms:9.4f} ms  "
          f"speed {speed:5.2f}", flush=True)  # fmt: skip


@section
def cache(args):
    for name, (heads, layers) in PUBLISHED.items():
        ours, latent = kv_bytes_per_token(heads, layers)
        ROWS.append({"section": "cache", "case": name, "vexact_bytes": ours, "stock_bytes": latent,
                     "ratio": ours / latent})  # fmt: skip
        print(f"cache    {name:18s} vexact {ours / 1024:8.1f} KiB/token  stock latent {latent / 1024:6.1f} "
              f"KiB/token  {ours / latent:5.1f}x")  # fmt: skip


def bench(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn) -> float:
    from triton.testing import do_bench_cudagraph

    from vexact_vllm.kernels.capture import gc_paused

    fn()
    with gc_paused():
        return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def _varlen(nseq, length, heads, grad=False):
    t = nseq * length
    q, k = (torch.randn(t, heads, D_NOPE + D_ROPE, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(t, heads, D_V, device=DEVICE, dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, length, device=DEVICE, dtype=torch.int32)
    return [x.requires_grad_(grad) for x in (q, k, v)], cu


@section
def prefill(args):
    for nseq, length in PREFILL_CASES[: 1 if args.quick else None]:
        _prefill_case(nseq, length, args.heads)


def _prefill_case(nseq, length, heads):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vexact_vllm.kernels import varlen_attention

    scale = (D_NOPE + D_ROPE) ** -0.5
    (q, k, v), cu = _varlen(nseq, length, heads)
    with torch.no_grad():
        ours = bench(lambda: varlen_attention(q, k, v, cu, scale))
    stock = bench(lambda: flash_attn_varlen_func(
        q, k, v, max_seqlen_q=length, cu_seqlens_q=cu, max_seqlen_k=length, cu_seqlens_k=cu,
        softmax_scale=scale, causal=True, fa_version=3))  # fmt: skip
    flops = 2 * nseq * length * length / 2 * heads * (D_NOPE + D_ROPE + D_V)
    record(
        "prefill", f"{nseq}x{length} H={heads} 192/128", ours, stock, "fa3", vexact_tflops=flops / ours / 1e9
    )


@section
def train(args):
    """vLLM's FlashAttention build has no backward: the stock side is torch SDPA at the same head sizes
    (padded batch of equal lengths, the backend torch picks for 192/128), as transformers runs the model."""
    for nseq, length in TRAIN_CASES[: 1 if args.quick else None]:
        _train_case(nseq, length, args.heads)


def _train_case(nseq, length, heads):
    from vexact_vllm.kernels import varlen_attention

    scale = (D_NOPE + D_ROPE) ** -0.5
    (q, k, v), cu = _varlen(nseq, length, heads, grad=True)
    g = torch.randn(nseq * length, heads, D_V, device=DEVICE, dtype=torch.bfloat16)

    def ours():
        varlen_attention(q, k, v, cu, scale).backward(g)

    qb, kb, vb = (x.detach().view(nseq, length, heads, -1).transpose(1, 2).contiguous().requires_grad_()
                  for x in (q, k, v))  # fmt: skip
    gb = g.view(nseq, length, heads, D_V).transpose(1, 2).contiguous()

    def stock():
        torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale).backward(gb)

    record("train", f"{nseq}x{length} H={heads} fwd+bwd", bench(ours), bench(stock), "sdpa")


def _decode_inputs(batch, context, heads, page):
    """Sequences of `context` keys on shuffled pages: vLLM's per-head cache [blocks, Hkv, page, D + Dv]
    (vexact's layout, split into key and value views) and the latent cache [blocks, page, 576]."""
    from vexact_vllm.attention import split_kv_cache

    pages = -(-context // page)
    blocks = batch * pages
    kv = torch.randn(blocks, heads, page, D_NOPE + D_ROPE + D_V, device=DEVICE, dtype=torch.bfloat16)
    k_cache, v_cache = split_kv_cache(kv, D_NOPE + D_ROPE, D_V)
    table = torch.randperm(blocks, device=DEVICE, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, heads, D_NOPE + D_ROPE, device=DEVICE, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32)
    return q, k_cache, v_cache, table, seq_lens, qsl


@section
def decode(args):
    for batch, context in DECODE_CASES[: 1 if args.quick else None]:
        _decode_case(batch, context, args.heads)


def _decode_case(batch, context, heads):
    from vexact_vllm.kernels import paged_attention

    scale = (D_NOPE + D_ROPE) ** -0.5
    q, kc, vc, bt, sl, qsl = _decode_inputs(batch, context, heads, 16)
    ours = bench_graph(lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale))
    label = f"B={batch} ctx={context} H={heads}"
    ours_bytes, latent_bytes = kv_bytes_per_token(heads, 1)
    print(f"decode   {label}: vexact {ours:.4f} ms, {batch * context * ours_bytes / ours / 1e9:.2f} TB/s")
    stocks = [
        ("fa3 (per head)", lambda: _fa3_decode(q, kc, vc, bt, sl, qsl, context, scale), ours_bytes),
        ("fa3-mla (latent)", lambda: _fa3_mla_decode(batch, context, heads, scale), latent_bytes),
        ("flashmla (latent)", lambda: _flashmla_decode(batch, context, heads, scale), latent_bytes),
    ]
    for stock, timed, per_token in stocks:
        try:
            stock_ms = timed()
        except Exception as e:  # a kernel or head-size pair missing from this build: the row says so
            print(f"decode   {label}: {stock} unavailable ({e})")
            ROWS.append(
                {"section": "decode", "case": label, "stock": stock, "vexact_ms": ours, "error": str(e)}
            )
            continue
        record("decode", label, ours, stock_ms, stock, vexact_tb_s=batch * context * ours_bytes / ours / 1e9,
               stock_tb_s=batch * context * per_token / stock_ms / 1e9)  # fmt: skip


def _fa3_decode(q, kc, vc, bt, sl, qsl, context, scale) -> float:
    """Milliseconds of FlashAttention-3's paged decode over the same per-head K/V at 192/128."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    fa_k, fa_v = kc.contiguous(), vc.contiguous()  # FA3's paged layout [blocks, page, Hkv, D]
    return bench_graph(lambda: flash_attn_varlen_func(
        q, fa_k, fa_v, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=context, seqused_k=sl,
        softmax_scale=scale, causal=True, block_table=bt, fa_version=3))  # fmt: skip


def _latent_inputs(batch, context, heads, page):
    """The latent cache [blocks, page, 576] on shuffled pages, its block table and lengths, and q in the
    absorbed form [B, H, 576] (the latent's 512 then the rotary 64)."""
    pages = -(-context // page)
    cache = torch.randn(batch * pages, page, LATENT + D_ROPE, device=DEVICE, dtype=torch.bfloat16)
    table = torch.randperm(batch * pages, device=DEVICE, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
    q = torch.randn(batch, heads, LATENT + D_ROPE, device=DEVICE, dtype=torch.bfloat16)
    return q, cache, table, seq_lens


def _fa3_mla_decode(batch, context, heads, scale) -> float:
    """Milliseconds of FlashAttention-3's MLA decode over the latent cache, as vLLM's FLASH_ATTN_MLA
    backend (the first choice on SM90) calls it: the rotary parts as q/k, the latent as v, q_nope as q_v."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q, cache, table, seq_lens = _latent_inputs(batch, context, heads, 16)
    q_nope, q_pe = q[..., :LATENT].contiguous(), q[..., LATENT:].contiguous()
    k_pe, kv_c = cache[..., LATENT:].unsqueeze(-2), cache[..., :LATENT].unsqueeze(-2)
    qsl = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32)
    return bench_graph(lambda: flash_attn_varlen_func(
        q=q_pe, k=k_pe, v=kv_c, q_v=q_nope, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=context,
        seqused_k=seq_lens, block_table=table, softmax_scale=scale, causal=True, fa_version=3))  # fmt: skip


def _flashmla_decode(batch, context, heads, scale) -> float:
    """Milliseconds of FlashMLA's decode over the latent cache (64-token pages), as vLLM's FLASHMLA
    backend calls it."""
    from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache, get_mla_metadata

    q, cache, table, seq_lens = _latent_inputs(batch, context, heads, 64)
    meta, _ = get_mla_metadata()
    return bench_graph(lambda: flash_mla_with_kvcache(
        q[:, None], cache[:, :, None], table, seq_lens, LATENT, meta, softmax_scale=scale, causal=True))  # fmt: skip


SECTIONS = {"cache": cache, "prefill": prefill, "decode": decode, "train": train}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="the first case of each section only")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--heads", type=int, default=16, help="attention heads on the GPU (default 16)")
    args = parser.parse_args(argv)
    chosen = [s for s in args.only.split(",") if s] or list(SECTIONS)
    if unknown := [s for s in chosen if s not in SECTIONS]:
        parser.error(f"unknown section(s) {unknown}; expected {list(SECTIONS)}")
    if chosen != ["cache"] and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (only --only cache runs without one)")
    torch.manual_seed(0)
    for name in chosen:
        SECTIONS[name](args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(os.path.join(args.out, "mla.json"), "w") as f:
        json.dump({"device": device, "heads": args.heads, "rows": ROWS}, f, indent=1)
    return 1 if any("error" in r and r["case"] == "ERROR" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
