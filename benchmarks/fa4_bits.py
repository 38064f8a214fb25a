"""FlashAttention-4 (flash-attn-4, CuTe DSL) on SM90 as ONE attention for training and inference:
does a query at position p get the same bits from the training varlen call (with and without the
log-sum-exp the backward needs), paged prefill (pages of 16 and 128 slots), chunked prefill from
unaligned starts, and per-token decode? Then its speed against vexact's Triton kernels.
docs/architecture.md#flashattention-4 says why and what it needs; needs CUDA and flash-attn-4 importable.

    python3 benchmarks/fa4_bits.py [--trials 3] [--no-timing]

Every FA4 call passes causal=True, num_splits=1, pack_gqa=True and one softmax scale. Prints, per
case, how many query rows differ from the training call (`torch.equal` per row); then milliseconds.
"""

from __future__ import annotations

import argparse

import torch

HQ, HKV, D = 16, 8, 128
SCALE = D**-0.5
DEVICE = "cuda"
MAX_LEN = 5000  # sequence lengths of the bit comparison: 1 .. MAX_LEN - 1, plus 1, 64 and 129


def _fa4(q, k, v, **kw):
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(q, k, v, softmax_scale=SCALE, causal=True, num_splits=1, pack_gqa=True, **kw)
    return out[0] if isinstance(out, tuple) else out


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _packed(lens, gen, grad=False):
    t = sum(lens)
    q, k, v = (torch.randn(t, h, D, generator=gen).to(DEVICE, torch.bfloat16) for h in (HQ, HKV, HKV))
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    return q, k, v, _cu(lens)


def _paged(k, v, lens, page, gen):
    """Each sequence's keys scattered over pages of `page` slots (finite filler elsewhere):
    caches [pages, page, Hkv, D] and the page table [B, W] int32."""
    counts = [-(-n // page) for n in lens]
    total = sum(counts) + 3
    free = torch.randperm(total, generator=gen).tolist()
    kc = torch.randn(total, page, HKV, D, generator=gen).to(DEVICE, k.dtype)
    vc = torch.randn(total, page, HKV, D, generator=gen).to(DEVICE, v.dtype)
    table = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens):
        for i in range(counts[b]):
            p = free.pop()
            table[b, i] = p
            lo, hi = start + i * page, min(start + (i + 1) * page, start + n)
            kc[p, : hi - lo] = k[lo:hi]
            vc[p, : hi - lo] = v[lo:hi]
        start += n
    return kc, vc, table.to(DEVICE)


def _rows_differ(got, want):
    return int((got != want).flatten(1).any(1).sum())


def bits(trials: int) -> list[tuple[str, int, int]]:
    """(case, rows compared, rows that differ from the training call)."""
    gen = torch.Generator().manual_seed(0)
    found: dict[str, list[int]] = {}

    def tally(case, got, want):
        n, bad = found.setdefault(case, [0, 0])
        found[case] = [n + got.shape[0], bad + _rows_differ(got, want)]

    for _ in range(trials):
        count = int(torch.randint(2, 7, (1,), generator=gen))
        lens = [int(x) for x in torch.randint(1, MAX_LEN, (count,), generator=gen)]
        lens += [1, 64, 129]
        q, k, v, cu = _packed(lens, gen)
        longest = max(lens)
        with torch.no_grad():
            train = _fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        with_lse = _fa4(qg, kg, vg, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        tally("training forward with LSE (grad on)", with_lse.detach(), train)
        used = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        for page in (16, 128):
            kc, vc, table = _paged(k, v, lens, page, gen)
            paged = dict(seqused_k=used, page_table=table, max_seqlen_k=longest)
            with torch.no_grad():
                out = _fa4(q, kc, vc, cu_seqlens_q=cu, max_seqlen_q=longest, **paged)
                tally(f"paged prefill, page {page}", out, train)
                starts = [int(torch.randint(0, n, (1,), generator=gen)) for n in lens]  # mostly unaligned
                rows = torch.cat([torch.arange(int(cu[b]) + s, int(cu[b + 1])) for b, s in enumerate(starts)]).to(DEVICE)
                out = _fa4(q[rows], kc, vc, cu_seqlens_q=_cu([n - s for n, s in zip(lens, starts)]),
                           max_seqlen_q=longest, **paged)  # fmt: skip
                tally(f"chunked prefill from unaligned starts, page {page}", out, train[rows])
                last = (cu[1:] - 1).long()
                out = _fa4(q[last], kc, vc, cu_seqlens_q=_cu([1] * len(lens)), max_seqlen_q=1, **paged)
                tally(f"decode, last positions, page {page}", out, train[last])
                pos = [int(torch.randint(0, n, (1,), generator=gen)) for n in lens]
                rows = torch.tensor([int(cu[b]) + p for b, p in enumerate(pos)], device=DEVICE)
                at = dict(paged, seqused_k=torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=DEVICE))
                out = _fa4(q[rows], kc, vc, cu_seqlens_q=_cu([1] * len(lens)), max_seqlen_q=1, **at)
                tally(f"decode at random positions, page {page}", out, train[rows])
    return [(case, n, bad) for case, (n, bad) in found.items()]


def _ms(fn):
    from triton.testing import do_bench

    fn()
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _one_capture_ms(fn):
    from bench_kernels import bench_one_capture

    with torch.no_grad():
        return bench_one_capture(fn)


def _prefill_case(n, length, gen):
    from vexact_vllm.kernels import varlen_attention

    q, k, v, cu = _packed([length] * n, gen)
    with torch.no_grad():
        fa = _ms(lambda: _fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length))
        ours = _ms(lambda: varlen_attention(q, k, v, cu, SCALE))
    return f"prefill {n} x {length}", fa, ours


def _train_case(n, length, gen):
    from vexact_vllm.kernels import varlen_attention

    q, k, v, cu = _packed([length] * n, gen, grad=True)
    g = torch.randn_like(q)

    def fa_step():
        out = _fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length,
                   deterministic=True)  # fmt: skip
        torch.autograd.grad(out, (q, k, v), g)

    def our_step():
        torch.autograd.grad(varlen_attention(q, k, v, cu, SCALE), (q, k, v), g)

    return f"train fwd+bwd {n} x {length}", _ms(fa_step), _ms(our_step)


def _decode_case(batch, context):
    from vexact_vllm.kernels import paged_attention

    kc = torch.randn(batch * context // 16, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(kc.shape[0], device="cuda", dtype=torch.int32).view(batch, -1)
    used = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    paged = dict(cu_seqlens_q=qsl, max_seqlen_q=1, seqused_k=used, page_table=table, max_seqlen_k=context)
    with torch.no_grad():
        fa = _one_capture_ms(lambda: _fa4(q, kc, vc, **paged))  # do_bench_cudagraph faulted here
        ours = _one_capture_ms(lambda: paged_attention(q, kc, vc, table, used, qsl, SCALE))
    return f"decode {batch} x {context} (page 16)", fa, ours


def timing():
    """(case, FA4 ms, vexact Triton ms), one case at a time (decode last)."""
    gen = torch.Generator().manual_seed(1)
    for n, length in ((16, 1024), (4, 4096), (1, 16384)):
        yield _prefill_case(n, length, gen)
    for n, length in ((8, 1024), (4, 4096), (2, 16384)):
        yield _train_case(n, length, gen)
    for batch, context in ((16, 4096), (16, 32768), (64, 8192), (256, 1024)):
        yield _decode_case(batch, context)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="random packed batches for the bit comparison")
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()
    import flash_attn.cute as cute_fa

    print(f"{torch.cuda.get_device_name()}, flash-attn-4 {getattr(cute_fa, '__version__', '?')}, torch {torch.__version__}")
    print(f"{'case':56s} {'rows':>7s} {'differ':>7s}")
    for case, n, bad in bits(args.trials):
        print(f"{case:56s} {n:7d} {bad:7d}", flush=True)
    if not args.no_timing:
        print(f"{'case':36s} {'FA4 ms':>9s} {'vexact ms':>10s} {'FA4 speed-up':>13s}")
        for case, fa, ours in timing():
            print(f"{case:36s} {fa:9.3f} {ours:10.3f} {ours / fa:13.2f}", flush=True)


if __name__ == "__main__":
    main()
