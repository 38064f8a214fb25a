"""Query-tile shapes of the forward attention kernels: are a row's bits the same, and what is faster?

    python benchmarks/ab_query_tiles.py [--configs 128x8x3,128x8x2] [--trials 40] [--no-time]

Each configuration (BLOCK_M x num_warps x num_stages) replaces `_FWD_CONFIGS` for head_dim 64 and
128 in turn. Bits: random packed batches (head_dim 64/128, GQA 1-8, lengths 1-2,500) through the
varlen (training) kernel and, as chunked prefills, through the paged (inference) kernel, each
`torch.equal` to the training kernel under the current configuration. Speed: prefill shapes vs
FlashAttention-3 (when vLLM is importable) and the training forward+backward vs SDPA-flash.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch


def _set(cfg):
    from vexact_vllm.kernels import attention_triton

    old = dict(attention_triton._FWD_CONFIGS)
    if cfg is not None:
        for d in (64, 128):
            attention_triton._FWD_CONFIGS[d] = cfg
    return old


def _restore(old):
    from vexact_vllm.kernels import attention_triton

    attention_triton._FWD_CONFIGS.clear()
    attention_triton._FWD_CONFIGS.update(old)


def _case(rng, device):
    d = rng.choice((64, 128))
    group = rng.choice((1, 2, 4, 7))
    hkv = rng.choice((1, 2, 4))
    lens = [rng.randint(1, 2500) for _ in range(rng.randint(1, 5))]
    t = sum(lens)
    gen = torch.Generator(device="cpu").manual_seed(rng.randrange(1 << 30))
    q = torch.randn(t, hkv * group, d, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(t, hkv, d, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(t, hkv, d, generator=gen).to(device, torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return d, group, lens, q, k, v, cu


def _paged(q, k, v, lens, rng, page=16):
    """The last q_len tokens of each sequence as a chunked prefill over a scrambled paged cache."""
    from vexact_vllm.kernels import paged_attention

    dev, hkv, d = k.device, k.shape[1], k.shape[2]
    nblk = [(n + page - 1) // page for n in lens]
    perm = torch.randperm(sum(nblk) + 3, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    kc = torch.zeros(len(perm), page, hkv, d, dtype=k.dtype, device=dev)
    vc = torch.zeros_like(kc)
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=dev)
    rows, qlens, start, used = [], [], 0, 0
    for b, n in enumerate(lens):
        blocks = perm[used : used + nblk[b]].to(dev)
        used += nblk[b]
        table[b, : nblk[b]] = blocks
        pos = torch.arange(n, device=dev)
        kc[blocks[pos // page], pos % page] = k[start : start + n]
        vc[blocks[pos // page], pos % page] = v[start : start + n]
        ql = rng.randint(1, n)
        rows.append(torch.arange(start + n - ql, start + n, device=dev))
        qlens.append(ql)
        start += n
    rows = torch.cat(rows)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = paged_attention(q[rows].contiguous(), kc, vc, table, seq_lens, qsl, q.shape[2] ** -0.5)
    return out, rows


def bits(configs, trials, device):
    from vexact_vllm.kernels import varlen_attention

    rng = random.Random(13)
    failures = 0
    for i in range(trials):
        d, group, lens, q, k, v, cu = _case(rng, device)
        scale = d**-0.5
        with torch.no_grad():
            ref = varlen_attention(q, k, v, cu, scale)
        for cfg in configs:
            if group > cfg[0]:
                continue
            old = _set(cfg)
            try:
                with torch.no_grad():
                    out = varlen_attention(q, k, v, cu, scale)
                    paged, rows = _paged(q, k, v, lens, rng)
            finally:
                _restore(old)
            same_v = torch.equal(out, ref)
            same_p = torch.equal(paged, ref[rows])
            failures += (not same_v) + (not same_p)
            if not (same_v and same_p):
                print(f"DIFFER trial {i} cfg {cfg} d={d} group={group} lens={lens}: varlen {same_v} paged {same_p}")
    print(f"bits: {trials} trials x {len(configs)} configurations, {failures} differing")
    return failures


def _config_name(cfg):
    return "current" if cfg is None else "x".join(map(str, cfg))


def _timed(cfg, fn):
    from triton.testing import do_bench

    old = _set(cfg)
    try:
        return do_bench(fn, return_mode="median")
    finally:
        _restore(old)


def _prefill_rows(configs, nseq, length, fa3_fn, hq=16, hkv=8, d=128):
    from triton.testing import do_bench

    from vexact_vllm.kernels import varlen_attention

    t, scale = nseq * length, d**-0.5
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    fa3 = float("nan")
    if fa3_fn is not None:
        fa3 = do_bench(lambda: fa3_fn(
            q, k, v, max_seqlen_q=length, cu_seqlens_q=cu, max_seqlen_k=length, cu_seqlens_k=cu,
            softmax_scale=scale, causal=True, fa_version=3), return_mode="median")  # fmt: skip
    for cfg in [None, *configs]:
        with torch.no_grad():
            ms = _timed(cfg, lambda: varlen_attention(q, k, v, cu, scale))
        print(f"{f'prefill {nseq}x{length}':28s} {_config_name(cfg):10s} {ms:8.3f} {fa3 / ms:7.2f}")


def _train_rows(configs, nseq, length, hq=16, hkv=8, d=128):
    from triton.testing import do_bench

    from vexact_vllm.kernels import varlen_attention

    t, scale = nseq * length, d**-0.5
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    g = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    rep = hq // hkv
    qb = q.detach().view(nseq, length, hq, d).transpose(1, 2).contiguous().requires_grad_()
    kb = k.detach().view(nseq, length, hkv, d).transpose(1, 2).repeat_interleave(rep, 1).contiguous().requires_grad_()
    vb = v.detach().view(nseq, length, hkv, d).transpose(1, 2).repeat_interleave(rep, 1).contiguous().requires_grad_()
    gb = g.view(nseq, length, hq, d).transpose(1, 2).contiguous()
    sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        qb, kb, vb, is_causal=True, scale=scale).backward(gb), return_mode="median")  # fmt: skip
    for cfg in [None, *configs]:
        ms = _timed(cfg, lambda: varlen_attention(q, k, v, cu, scale).backward(g))
        print(f"{f'train fwd+bwd {nseq}x{length}':28s} {_config_name(cfg):10s} {ms:8.3f} {sdpa / ms:7.2f} (vs SDPA)")


def timings(configs):
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    print(f"{'case':28s} {'config':10s} {'ms':>8s} {'vs FA3':>7s}")
    for nseq, length in [(16, 1024), (4, 4096), (1, 16384)]:
        _prefill_rows(configs, nseq, length, flash_attn_varlen_func)
    for nseq, length in [(8, 1024), (4, 4096), (2, 16384)]:
        _train_rows(configs, nseq, length)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="128x8x3,128x8x2")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--no-time", action="store_true")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    failures = bits(configs, args.trials, device)
    if device == "cuda" and not args.no_time:
        timings(configs)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
