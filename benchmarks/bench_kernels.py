"""Time each vexact kernel against the stock path on one GPU, in one run, and print the ratios.

    python benchmarks/bench_kernels.py [--out DIR] [--quick]

Sections: GEMM vs torch.mm (cuBLAS) at Qwen3-1.7B and Qwen3-8B weight shapes; paged decode attention
vs vLLM's FlashAttention-3 (`vllm.vllm_flash_attn`, when vLLM is importable); varlen prefill vs FA3
varlen; training attention forward+backward vs torch SDPA (flash backend); fused linear log-prob vs
`torch.log_softmax(h @ W.T)`; Qwen3's q/k norm + RoPE vs vLLM's rms_norm and rotary_embedding ops; a Qwen3-1.7B decoder layer's training forward+backward vs the same
layer in stock transformers. "speed" is stock time / vexact time (1.0 = as fast as stock). Medians
of CUDA-event timings after warm-up (triton.testing.do_bench). Full numbers go to DIR/kernels.json.
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


@contextlib.contextmanager
def environment(**changes: str | None):
    """os.environ with `changes` inside the block (None: the variable removed), as it was after; the
    kernels' settings (kernels/settings.py, read once) are read again on entry and on exit."""
    from vexact_vllm.kernels.settings import refresh_settings

    def put(values):
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    saved = {name: os.environ.get(name) for name in changes}
    put(changes)
    try:
        refresh_settings()
        yield
    finally:
        put(saved)
        refresh_settings()


def bench(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn) -> float:
    """Kernel time without the Python launch cost (vLLM replays CUDA graphs at decode)."""
    from triton.testing import do_bench_cudagraph

    from vexact_vllm.kernels.capture import gc_paused

    fn()
    with gc_paused():  # see kernels/capture.py: a cycle collected mid-capture broke the 32k decode case
        return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def bench_one_capture(fn, replays: int = 200) -> float:
    """Milliseconds a replay of a CUDA graph holding ONE call of fn (captured once by
    torch.cuda.graph, as vLLM captures a step), median of `replays` timed replays. For kernels whose
    capture under do_bench_cudagraph (several calls in one graph) is in question: FA4's faulted there."""
    from vexact_vllm.kernels.capture import gc_paused

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


def record(section, case, ours_ms, stock_ms, target=None, **extra):
    speed = stock_ms / ours_ms if ours_ms and stock_ms else float("nan")
    row = {"section": section, "case": case, "vexact_ms": ours_ms, "stock_ms": stock_ms, "speed": speed,
           "target": target, "meets": None if target is None else speed >= target, **extra}
    ROWS.append(row)
    print(f"{section:10s} {case:40s} vexact {ours_ms:9.4f} ms  stock {stock_ms:9.4f} ms  speed {speed:5.2f}"
          + (f"  (target {target})" if target else ""), flush=True)


@section
def gemm(quick):
    from vexact_vllm.kernels import linear

    shapes = {
        "1.7B": {"q/o": (2048, 2048), "kv": (1024, 2048), "gate/up": (6144, 2048), "down": (2048, 6144),
                 "lm_head": (151936, 2048)},
        "8B": {"q/o": (4096, 4096), "kv": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288),
               "lm_head": (151936, 4096)},
    }
    ms = [1, 8, 16, 32, 64, 256, 1024, 8192] if not quick else [1, 16, 64, 1024]
    for model, table in shapes.items():
        for name, (n, k) in table.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for m in ms:
                if name == "lm_head" and m > 1024:
                    continue
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ours = bench_graph(lambda x=x, w=w: linear(x, w))
                stock = bench_graph(lambda x=x, w=w: torch.mm(x, w.t()))
                tflops = 2 * m * n * k / ours / 1e9
                record("gemm", f"{model} {name} N={n} K={k} M={m}", ours, stock, 0.85 if m >= 256 else 0.7,
                       vexact_tflops=tflops)


def _paged_inputs(batch, context, hq, hkv, d, block_size=16, device="cuda", dtype=torch.bfloat16):
    """One decode step over `context` keys a sequence on a shuffled block table. The table holds every
    page a sequence's keys touch (a partly filled last page included): a shorter row let the kernel
    read past the table at contexts off a page boundary (the 16 x 3,700 step faulted)."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
    return q, k_cache, v_cache, block_table, seq_lens, qsl


TIMED_STAGES: list[int] = []  # --paged-stages: pipelining depths of the paged kernel to time (speed only)


@section
def decode_attention(quick):
    """Paged decode at the default bench's batch and at long context (8k-32k keys, fewer requests)."""
    for batch, context in [(256, 1024), (64, 8192), (32, 6144), (16, 32768)] if not quick else [(256, 1024), (16, 32768)]:
        _decode_case(batch, context)


def _decode_case(batch, context):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vexact_vllm.kernels import paged_attention
    from vexact_vllm.kernels.attention import paged_triton

    hq, hkv, d = 16, 8, 128
    q, kc, vc, bt, sl, qsl = _paged_inputs(batch, context, hq, hkv, d)
    scale = d**-0.5
    stock = bench_graph(lambda: flash_attn_varlen_func(
        q, kc, vc, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=context, seqused_k=sl,
        softmax_scale=scale, causal=True, block_table=bt, fa_version=3))
    bytes_moved = 2 * kc.numel() * kc.element_size()
    reference = paged_attention(q, kc, vc, bt, sl, qsl, scale)
    for stages in [None, *TIMED_STAGES]:  # None: the kernel's own configuration
        if stages is not None:
            paged_triton.PAGED_STAGES[d] = stages
        try:
            same = torch.equal(paged_attention(q, kc, vc, bt, sl, qsl, scale), reference)
            ours = bench_graph(lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale))
        finally:
            paged_triton.PAGED_STAGES.pop(d, None)
        label = "" if stages is None else f" stages={stages}{'' if same else ' BITS DIFFER'}"
        record("decode", f"B={batch} ctx={context} Hq={hq} Hkv={hkv} D={d}{label}", ours, stock,
               0.8 if context <= 1024 else 0.9, vexact_tb_s=bytes_moved / ours / 1e9, same_bits=same)


def _shared_prefix_inputs(groups, samples, prompt, generated, shared, hq, hkv, d, page=16, seed=0):
    """A decode step of a rollout engine: `groups` prompts (lengths drawn from `prompt`, a (lo, hi)
    range) x `samples` each, every sample `generated` tokens in. With `shared`, the samples of a
    prompt read its whole prompt blocks from the same cache blocks (vLLM's prefix caching); the rest
    of each sample's keys are its own blocks. Caches in vexact's engine layout ([blocks, Hkv, page,
    2D], keys then values, vexact_vllm/attention.py) and in FlashAttention's ([blocks, page, Hkv, D])."""
    rng = torch.Generator().manual_seed(seed)
    lens, tables, next_block = [], [], 0
    for _ in range(groups):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=rng))
        n = p + generated
        full = p // page if shared else 0  # blocks read by every sample of the prompt
        common = list(range(next_block, next_block + full))
        next_block += full
        for _ in range(samples):
            own = -(-n // page) - full
            tables.append(common + list(range(next_block, next_block + own)))
            next_block += own
            lens.append(n)
    perm = torch.randperm(next_block, generator=rng)  # blocks scattered over the cache, as after churn
    width = max(len(t) for t in tables)
    block_table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_table[i, : len(t)] = perm[torch.tensor(t)].to(torch.int32)
    kv = torch.randn(next_block, hkv, page, 2 * d, device="cuda", dtype=torch.bfloat16)
    engine = (kv.transpose(1, 2)[..., :d], kv.transpose(1, 2)[..., d:])  # [blocks, page, Hkv, D] views
    fa = (engine[0].contiguous(), engine[1].contiguous())
    batch = len(lens)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    return q, engine, fa, block_table.cuda(), seq_lens, qsl


# Speed-only launch choices of the paged kernel timed by decode_rollout: name -> (stages, shared-prompt
# groups). Stages None: the kernel's own.
PAGED_VARIANTS = {"own": (None, False), "stages5": (5, False), "groups": (None, True), "groups stages5": (5, True)}


@section
def decode_rollout(quick):
    """Paged decode as a rollout engine runs it (vexact's cache layout, scattered blocks, lengths
    that differ per prompt): GRPO's 32 prompts x 8 samples sharing each prompt's blocks (and the
    same without sharing, to see what the shared reads are worth), and a long-rollout step.
    Each of PAGED_VARIANTS against FlashAttention-3 on the same blocks, bits checked equal."""
    cases = [("grpo 32x8 shared", 32, 8, (256, 1024), 600, True), ("grpo 32x8 private", 32, 8, (256, 1024), 600, False),
             ("long 32x1", 32, 1, (1024, 4096), 2000, False)]  # fmt: skip
    # The shared-prompt groups take no key split: every variant runs the unsplit kernel.
    with environment(VEXACT_KEY_SPLIT="0"):
        for label, groups, samples, prompt, generated, shared in cases[:1] if quick else cases:
            _decode_rollout_case(label, groups, samples, prompt, generated, shared)


def _decode_rollout_case(label, groups, samples, prompt, generated, shared):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vexact_vllm.kernels import max_group_members, paged_attention, shared_prefix_groups
    from vexact_vllm.kernels.attention import paged_triton

    hq, hkv, d = 16, 8, 128
    q, (kc, vc), (kf, vf), bt, sl, qsl = _shared_prefix_inputs(groups, samples, prompt, generated, shared, hq, hkv, d)
    scale, max_len = d**-0.5, int(sl.max())
    stock = bench_graph(lambda: flash_attn_varlen_func(
        q, kf, vf, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=max_len, seqused_k=sl,
        softmax_scale=scale, causal=True, block_table=bt, fa_version=3))  # fmt: skip
    reference = paged_attention(q, kc, vc, bt, sl, qsl, scale)
    grouping = shared_prefix_groups(bt, sl, qsl, kc.shape[1], max_group_members(d, hq // hkv))  # as the builder
    for name, (stages, groups) in PAGED_VARIANTS.items():
        by_prompt = grouping if groups else None
        if stages is not None:
            paged_triton.PAGED_STAGES[d] = stages
        try:
            same = torch.equal(paged_attention(q, kc, vc, bt, sl, qsl, scale, shared=by_prompt), reference)
            ours = bench_graph(lambda g=by_prompt: paged_attention(q, kc, vc, bt, sl, qsl, scale, shared=g))
        finally:
            paged_triton.PAGED_STAGES.pop(d, None)
        record("rollout", f"{label} {name}{'' if same else ' BITS DIFFER'}", ours, stock, 0.9,
               mean_keys=float(sl.float().mean()), same_bits=same)


def _varlen_inputs(nseq, length, hq, hkv, d, grad=False):
    t = nseq * length
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    return q, k, v, cu


@section
def prefill_attention(quick):
    """Varlen causal prefill vs FA3 at 1k, 4k and 16k tokens per sequence (16k tokens in all)."""
    for nseq, length in [(16, 1024), (4, 4096), (1, 16384)] if not quick else [(16, 1024)]:
        _prefill_case(nseq, length)


def _prefill_case(nseq, length):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from vexact_vllm.kernels import varlen_attention

    hq, hkv, d = 16, 8, 128
    q, k, v, cu = _varlen_inputs(nseq, length, hq, hkv, d)
    scale = d**-0.5
    with torch.no_grad():
        ours = bench(lambda: varlen_attention(q, k, v, cu, scale))
    stock = bench(lambda: flash_attn_varlen_func(
        q, k, v, max_seqlen_q=length, cu_seqlens_q=cu, max_seqlen_k=length, cu_seqlens_k=cu,
        softmax_scale=scale, causal=True, fa_version=3))
    flops = 4 * nseq * length * length / 2 * hq * d
    record("prefill", f"{nseq}x{length} Hq={hq} Hkv={hkv} D={d} fwd", ours, stock, 0.8,
           vexact_tflops=flops / ours / 1e9)


@section
def training_attention(quick):
    """Varlen training attention forward+backward vs SDPA-flash at 8k, 16k and 32k packed tokens."""
    for nseq, length in [(8, 1024), (4, 4096), (2, 16384)] if not quick else [(8, 1024)]:
        _training_attention_case(nseq, length)


def _training_attention_case(nseq, length):
    from vexact_vllm.kernels import varlen_attention

    hq, hkv, d = 16, 8, 128
    q, k, v, cu = _varlen_inputs(nseq, length, hq, hkv, d, grad=True)
    scale = d**-0.5
    g = torch.randn(nseq * length, hq, d, device="cuda", dtype=torch.bfloat16)

    def ours():
        varlen_attention(q, k, v, cu, scale).backward(g)

    qb = q.detach().view(nseq, length, hq, d).transpose(1, 2).contiguous().requires_grad_()
    kb = k.detach().view(nseq, length, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1).contiguous()
    vb = v.detach().view(nseq, length, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1).contiguous()
    kb.requires_grad_(), vb.requires_grad_()
    gb = g.view(nseq, length, hq, d).transpose(1, 2).contiguous()

    def stock():
        torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale).backward(gb)

    record("train-attn", f"{nseq}x{length} D={d} fwd+bwd vs SDPA", bench(ours), bench(stock), 0.8)


@section
def rope(quick):
    """Qwen3's q/k RMSNorm + RoPE of one layer: our one fused launch against stock two ways: vLLM's
    custom ops (rms_norm on q, on k, then rotary_embedding in place: its eager layer) and the same
    math in torch compiled by Inductor (what stock's compiled engine runs: fused kernels, as its
    profile shows), CUDA-graph replays."""
    for model, hq, hkv in (("1.7B", 16, 8), ("8B", 32, 8)):
        for t in (16, 256) if quick else (16, 128, 256, 512, 8192):
            _rope_case(model, t, hq, hkv)


def _rope_native(q, k, positions, cos_sin, wq, wk, eps=1e-6):
    """Stock's q/k norm and NeoX rotation in torch (vLLM's RMSNorm and RotaryEmbedding forward_native)."""

    def norm(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(norm(q, wq)), rotate(norm(k, wk))


def _rope_inputs(t, hq, hkv, d=128):
    """(q, k, positions, the fp32 cos|sin cache, the norm weight) of one layer's q/k norm + RoPE:
    q and k views of one fused projection, as in the layer; the Qwen3-8B cache (40,960 positions)."""
    from vexact_vllm.kernels import rope_cache

    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    positions = torch.randint(0, 40960, (t,), device="cuda")
    cache = rope_cache(d, 40960, 1000000.0).cuda()
    return q, k, positions, cache, torch.ones(d, device="cuda", dtype=torch.bfloat16)


def _rope_case(model, t, hq, hkv, d=128):
    from vllm import _custom_ops as ops

    from vexact_vllm.kernels.norms.rope_triton import apply_rope_triton

    q, k, positions, cache, w = _rope_inputs(t, hq, hkv, d)
    wq = wk = w
    cos_sin = cache.to(torch.bfloat16)  # vLLM keeps its cos|sin cache in the model dtype
    q_n, k_n = torch.empty_like(q), torch.empty_like(k)

    def custom_ops():
        ops.rms_norm(q_n, q, wq, 1e-6)
        ops.rms_norm(k_n, k, wk, 1e-6)
        ops.rotary_embedding(positions, q_n.view(t, -1), k_n.view(t, -1), d, cos_sin, True)

    compiled = torch.compile(_rope_native, fullgraph=True, dynamic=False)
    ours = bench_graph(lambda: apply_rope_triton(q, k, positions, cache, (wq, wk, 1e-6)))
    case = f"{model} qk-norm+rope T={t}"  # Hq, Hkv: the model's
    record("rope", f"{case} vs ops", ours, bench_graph(custom_ops), 1.0)
    record("rope", f"{case} vs Inductor", ours, bench_graph(lambda: compiled(q, k, positions, cos_sin, wq, wk)), 1.0)


@section
def linear_logprob(quick):
    from vexact_vllm.kernels import linear_token_log_probs

    m, h, vocab = (8192 if not quick else 2048), 2048, 151936
    hidden = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    tokens = torch.randint(0, vocab, (m,), device="cuda")

    def ours():
        linear_token_log_probs(hidden, weight, tokens, 1.0).sum().backward()

    def stock():
        logits = (hidden @ weight.t()).float()
        torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).sum().backward()

    record("logprob", f"M={m} H={h} V={vocab} fwd+bwd", bench(ours, 5, 20), bench(stock, 5, 20), None,
           stock_peak_gib=None)


@section
def decoder_layer(quick):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    from vexact_vllm.kernels import rope_cache
    from vexact_vllm.model_patches.attention_context import PackedAttention
    from vexact_vllm.model_patches.config import DecoderConfig
    from vexact_vllm.model_patches.layers import DecoderLayer

    cfg = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=1, vocab_size=151936, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    nseq, length = 8, 1024
    t = nseq * length
    stock = Qwen3DecoderLayer(cfg, 0).cuda().to(torch.bfloat16)
    ours = DecoderLayer(DecoderConfig.from_hf(cfg), 0).cuda().to(torch.bfloat16)
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(length, device="cuda").repeat(nseq)
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    rope = rope_cache(128, 4096, 1e6).cuda()
    ctx = PackedAttention(cu)

    def run_ours():
        h, r = ours(x, None, pos, rope, ctx)
        (h.float().sum() + r.float().sum()).backward()

    xb = x.detach().view(nseq, length, -1).requires_grad_()
    rot = Qwen3RotaryEmbedding(cfg).cuda()
    pos_b = torch.arange(length, device="cuda")[None].expand(nseq, -1)
    cos_sin = rot(xb, pos_b)

    def run_stock():
        out = stock(xb, attention_mask=None, position_ids=pos_b, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    record("layer", f"Qwen3-1.7B layer {nseq}x{length} fwd+bwd", bench(run_ours, 5, 30), bench(run_stock, 5, 30), 0.8)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated sections")
    parser.add_argument("--paged-stages", default="",
                        help="comma-separated pipelining depths of the paged decode kernel to time beside its own")
    args = parser.parse_args()
    TIMED_STAGES.extend(int(x) for x in args.paged_stages.split(",") if x)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    sections = {"gemm": gemm, "decode": decode_attention, "rollout": decode_rollout, "prefill": prefill_attention,
                "train-attn": training_attention, "rope": rope, "logprob": linear_logprob, "layer": decoder_layer}
    chosen = [s for s in args.only.split(",") if s] or list(sections)
    for name in chosen:
        sections[name](args.quick)
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": ROWS}, f, indent=1)
    print("\nsection    case                                      speed  target  meets")
    for r in ROWS:
        if "speed" in r:
            meets = "-" if r["meets"] is None else ("yes" if r["meets"] else "NO")
            tgt = "-" if r["target"] is None else f"{r['target']:.2f}"
            print(f"{r['section']:10s} {r['case'][:44]:44s} {r['speed']:5.2f}  {tgt:6s}  {meets}")
        else:
            print(f"{r['section']:10s} ERROR (see log)")


if __name__ == "__main__":
    main()
