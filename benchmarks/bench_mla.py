"""Attention at DeepSeek's MLA sizes on one GPU: vexact's kernels over the latent (the absorbed form of
model_patches/mla.py: q 512 + 64 against one shared key head of 512 + 64, values the 512 latent)
against what stock vLLM runs on Hopper, prefill, decode and training; and what each KV cache holds.

    python benchmarks/bench_mla.py [--out DIR] [--quick] [--only prefill,decode,train] [--heads 16]
        [--decode-pages 16,64] [--decode-stages 1,2,3] [--decode-block-m 16,64] [--decode-warps 4,8]

Sections (16 heads by default: Moonlight-16B-A3B and DeepSeek-V2-Lite at TP=1, DeepSeek-V3 at TP=8):
- cache: KV bytes per token of vexact's cache and of stock's (both vLLM's MLA spec: kv_lora_rank +
  qk_rope_head_dim per layer), bf16, for the published shapes; the only section that runs without a
  GPU (`--only cache`).
- prefill: varlen causal attention. ours: `varlen_attention` over the latent (the training kernel,
  576-wide scores, 512-wide values, every query head reading the one key head); fa3: FlashAttention-3
  at 192/128 on K and V decompressed per head, stock vLLM's MLA prefill on SM90 (`vllm.vllm_flash_attn`,
  fa_version=3).
- decode: one query per sequence over `context` keys of the latent cache (scattered pages): ours
  `paged_attention` (16-token pages); fa3-mla: FlashAttention-3 over the latent as vLLM's FLASH_ATTN_MLA
  backend calls it (the first on SM90: the rotary 64 as q/k, the 512 latent as v, q_nope as q_v);
  flashmla: FlashMLA (64-token pages), the next backend. The same bytes on every side. `--decode-pages`,
  `--decode-stages`, `--decode-block-m` and `--decode-warps` time ours at other page sizes, pipelining
  depths, row tiles and warp counts, each against the same stock figures and each with `same_bits`: its output equal to the
  kernel's own launch (pages, depths and row tiles must keep every bit: decode takes smaller row tiles
  than training, `core_triton.latent_config`), and where not, how many values differ and by how much
  (`differing`).
- train: ours forward+backward over the latent against torch SDPA's at 192/128 (vLLM's FlashAttention
  has no backward).
The per-head absorption and up-projection GEMMs around the attention (kernels.head_linear) are not
timed on either side. "speed" is stock time / vexact time. Medians of CUDA-event timings
(triton.testing.do_bench); decode under a CUDA graph (vLLM replays graphs at decode). Every number goes
to DIR/mla.json.
"""

from __future__ import annotations

import argparse
import contextlib
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


def kv_bytes_per_token(layers: int, kv_lora_rank: int = LATENT, qk_rope: int = D_ROPE, itemsize: int = 2) -> int:
    """KV cache bytes per token of vexact's cache, which are stock's: one kv_lora_rank + qk_rope latent
    row per layer (vLLM's MLA spec), whatever the head count."""
    return (kv_lora_rank + qk_rope) * layers * itemsize


def record(section, case, ours_ms, stock_ms, stock="", **extra):
    speed = stock_ms / ours_ms if ours_ms and stock_ms else float("nan")
    ROWS.append({"section": section, "case": case, "stock": stock, "vexact_ms": ours_ms, "stock_ms": stock_ms,
                 "speed": speed, **extra})  # fmt: skip
    print(f"{section:8s} {case:34s} vexact {ours_ms:9.4f} ms  {stock or 'stock':14s} {stock_ms:9.4f} ms  "
          f"speed {speed:5.2f}", flush=True)  # fmt: skip


@section
def cache(args):
    for name, (_, layers) in PUBLISHED.items():
        per_token = kv_bytes_per_token(layers)
        ROWS.append({"section": "cache", "case": name, "vexact_bytes": per_token, "stock_bytes": per_token,
                     "ratio": 1.0})  # fmt: skip
        print(f"cache    {name:18s} vexact {per_token / 1024:6.1f} KiB/token  stock {per_token / 1024:6.1f} "
              "KiB/token  1.0x (the same latent rows)")  # fmt: skip


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
    """Packed sequences decompressed per head at 192/128 (stock's prefill and training inputs)."""
    t = nseq * length
    q, k = (torch.randn(t, heads, D_NOPE + D_ROPE, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(t, heads, D_V, device=DEVICE, dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, length, device=DEVICE, dtype=torch.int32)
    return [x.requires_grad_(grad) for x in (q, k, v)], cu


def _latent_varlen(nseq, length, heads, grad=False):
    """The same sequences in the absorbed form: q [T, H, 576], the latent kv [T, 1, 576]."""
    t = nseq * length
    q = torch.randn(t, heads, LATENT + D_ROPE, device=DEVICE, dtype=torch.bfloat16).requires_grad_(grad)
    kv = torch.randn(t, 1, LATENT + D_ROPE, device=DEVICE, dtype=torch.bfloat16).requires_grad_(grad)
    cu = torch.arange(0, t + 1, length, device=DEVICE, dtype=torch.int32)
    return q, kv, cu


@section
def prefill(args):
    for nseq, length in PREFILL_CASES[: 1 if args.quick else None]:
        _prefill_case(nseq, length, args.heads)


def _prefill_case(nseq, length, heads):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vexact_vllm.kernels import varlen_attention

    scale = (D_NOPE + D_ROPE) ** -0.5
    ql, kv, cu = _latent_varlen(nseq, length, heads)
    with torch.no_grad():
        ours = bench(lambda: varlen_attention(ql, kv, kv[..., :LATENT], cu, scale))
    (q, k, v), _ = _varlen(nseq, length, heads)
    stock = bench(lambda: flash_attn_varlen_func(
        q, k, v, max_seqlen_q=length, cu_seqlens_q=cu, max_seqlen_k=length, cu_seqlens_k=cu,
        softmax_scale=scale, causal=True, fa_version=3))  # fmt: skip
    flops = 2 * nseq * length * length / 2 * heads * (2 * LATENT + D_ROPE)  # the latent's QK and PV
    record("prefill", f"{nseq}x{length} H={heads}", ours, stock, "fa3 192/128", vexact_tflops=flops / ours / 1e9)


@section
def train(args):
    """vLLM's FlashAttention build has no backward: the stock side is torch SDPA at the same head sizes
    (padded batch of equal lengths, the backend torch picks for 192/128), as transformers runs the model."""
    for nseq, length in TRAIN_CASES[: 1 if args.quick else None]:
        _train_case(nseq, length, args.heads)


def _train_case(nseq, length, heads):
    from vexact_vllm.kernels import varlen_attention

    scale = (D_NOPE + D_ROPE) ** -0.5
    ql, kv, cu = _latent_varlen(nseq, length, heads, grad=True)
    gl = torch.randn(nseq * length, heads, LATENT, device=DEVICE, dtype=torch.bfloat16)

    def ours():
        varlen_attention(ql, kv, kv[..., :LATENT], cu, scale).backward(gl)

    (q, k, v), _ = _varlen(nseq, length, heads, grad=True)
    g = torch.randn(nseq * length, heads, D_V, device=DEVICE, dtype=torch.bfloat16)

    qb, kb, vb = (x.detach().view(nseq, length, heads, -1).transpose(1, 2).contiguous().requires_grad_()
                  for x in (q, k, v))  # fmt: skip
    gb = g.view(nseq, length, heads, D_V).transpose(1, 2).contiguous()

    def stock():
        torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale).backward(gb)

    record("train", f"{nseq}x{length} H={heads} fwd+bwd", bench(ours), bench(stock), "sdpa 192/128")


@section
def decode(args):
    variants = [(page, stages, block_m, warps) for page in getattr(args, "decode_pages", None) or [16]
                for stages in getattr(args, "decode_stages", None) or [None]
                for block_m in getattr(args, "decode_block_m", None) or [None]
                for warps in getattr(args, "decode_warps", None) or [None]]  # fmt: skip
    for batch, context in DECODE_CASES[: 1 if args.quick else None]:
        _decode_case(batch, context, args.heads, variants)


@contextlib.contextmanager
def _latent_launch(stages, block_m, warps=None):
    """paged_attention's latent launches with another num_stages (PAGED_STAGES: speed only), another
    row tile (BLOCK_M: a different dot shape, whose bits the decode section compares) and another
    num_warps; None: its own."""
    from vexact_vllm.kernels.attention import paged_triton
    from vexact_vllm.kernels.attention.core_triton import latent_group

    own = paged_triton.latent_config

    def config(latent_dim, rope_dim, heads, decode=False, fp32=False):
        group, block, own_warps, depth = own(latent_dim, rope_dim, heads, decode, fp32)
        if block_m is not None:
            group, block = latent_group(heads, block_m), block_m
        return group, block, warps or own_warps, depth

    if stages is not None:
        paged_triton.PAGED_STAGES[LATENT] = stages
    paged_triton.latent_config = config
    try:
        yield
    finally:
        paged_triton.PAGED_STAGES.pop(LATENT, None)
        paged_triton.latent_config = own


def differences(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    """(how many values' bits differ, the largest |got - want| among them): a rare difference points at
    a sum's rounding, one everywhere at the products themselves."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differ = got.view(bits) != want.view(bits)
    count = int(differ.sum())
    return count, float((got.float() - want.float())[differ].abs().max()) if count else 0.0


def _decode_case(batch, context, heads, variants=((16, None, None, None),)):
    """vexact's decode for each (page size, num_stages, BLOCK_M, num_warps) variant (None: the kernel's own), each
    with `same_bits`: its output equal to the kernel's own launch on the same inputs (a page size or a
    depth or a row tile must never change a bit), then each stock kernel once, every variant against it."""
    from vexact_vllm.kernels import paged_attention

    scale = (D_NOPE + D_ROPE) ** -0.5
    qsl = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32)
    per_token = kv_bytes_per_token(1)
    timed = []
    for page, stages, block_m, warps in variants:
        q, cache, table, seq_lens = _latent_inputs(batch, context, heads, page)
        k_cache = cache[:, :, None]  # [blocks, page, 1, 576]: the key head; the values its first 512 cells
        args = (q, k_cache, k_cache[..., :LATENT], table, seq_lens, qsl, scale)
        own = paged_attention(*args)
        with _latent_launch(stages, block_m, warps):
            differing, most = differences(paged_attention(*args), own)
            same = differing == 0
            ms = bench_graph(lambda args=args: paged_attention(*args))
        label = f"B={batch} ctx={context} H={heads}"
        if list(variants) != [(16, None, None, None)]:
            label += f" page={page} stages={stages or 'own'} block_m={block_m or 'own'}"
            label += f" warps={warps}" if warps else ""
        diff = "" if same else f" ({differing:,} of {own.numel():,} values differ, max |diff| {most:.3g})"
        print(f"decode   {label}: vexact {ms:.4f} ms, {batch * context * per_token / ms / 1e9:.2f} TB/s, "
              f"same bits as its own launch: {same}{diff}")  # fmt: skip
        timed.append((label, ms, same, differing))
    stocks = [
        ("fa3-mla", lambda: _fa3_mla_decode(batch, context, heads, scale)),
        ("flashmla", lambda: _flashmla_decode(batch, context, heads, scale)),
    ]
    for stock, timer in stocks:
        try:
            stock_ms = timer()
        except Exception as e:  # a kernel or head-size pair missing from this build: the row says so
            print(f"decode   B={batch} ctx={context} H={heads}: {stock} unavailable ({e})")
            ROWS.extend({"section": "decode", "case": label, "stock": stock, "vexact_ms": ms, "same_bits": same,
                         "differing": differing, "error": str(e)} for label, ms, same, differing in timed)  # fmt: skip
            continue
        for label, ms, same, differing in timed:
            record("decode", label, ms, stock_ms, stock, vexact_tb_s=batch * context * per_token / ms / 1e9,
                   stock_tb_s=batch * context * per_token / stock_ms / 1e9, same_bits=same,
                   differing=differing)  # fmt: skip


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
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--decode-pages", type=ints, default=[16],
                        help="decode: vexact's cache page sizes to time (default 16, vLLM's block size)")
    parser.add_argument("--decode-stages", type=ints, default=[],
                        help="decode: vexact's pipelining depths (num_stages) to time; default the kernel's own")
    parser.add_argument("--decode-block-m", type=ints, default=[],
                        help="decode: vexact's row tiles (BLOCK_M) to time, each checked for the bits of its own")
    parser.add_argument("--decode-warps", type=ints, default=[],
                        help="decode: vexact's num_warps to time; default the kernel's own")
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
