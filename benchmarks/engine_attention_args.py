"""The paged attention kernel on the engine's own arguments (CUDA, vLLM): why a decode layer takes
longer inside vLLM than in `sweep_paged_depth.py` (session 23's 8B `long:16` profile: 142.5 us a
layer in the engine against 107-113 us in the microbench on the same lengths).

    python3 benchmarks/engine_attention_args.py [--model qwen3-8b-shape] [--steps 1200] [--requests 16]

Runs a vexact engine in this process (eager, so every layer's call goes through Python), lets it
decode `--steps` tokens a request, then, at the first layer's call of the next decode step, times
our kernel (CUDA-graph replays, median) on:

  engine         the engine's tensors as they are (query view, cache views, block table, output view)
  contiguous q   the same with q and out copied to contiguous tensors
  packed table   the same with the block table cut to the pages the longest sequence uses
  fresh cache    new random caches of the same lengths on a shuffled table (the microbench's inputs)
  spread table   the engine's cache, each row's pages drawn at random from the whole cache (as far
                 apart as the engine's cache allows: address range and TLB reach, against the
                 compact fresh cache)
  split N        the engine's call with VEXACT_KEY_SPLIT=N (other bits past key N: timing only;
                 the rows above take the environment's setting, 2,048 when unset)
  after a GEMM   the engine's call right after a 200 MB-weight GEMM in the same graph (minus the GEMM)
  FA3            vLLM's FlashAttention-3 on the engine's cache views (as stock would run this step)

and prints the arguments' shapes, strides, alignments, the lengths and the depth the launch gets.
All rows must give the same bits as the engine's call (checked). Nothing here changes the engine.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from bench_kernels import _paged_inputs, bench_graph, environment


def _describe(name, t):
    return f"  {name:12s} shape {tuple(t.shape)} stride {tuple(t.stride())} dtype {t.dtype} ptr%256 {t.data_ptr() % 256}"


def _host_ms(fn, calls=3):
    """Wall milliseconds a call (the CPU dry run: checks the flow, times nothing of interest)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1000 / calls


def _after_gemm(q, attend):
    """The engine's context: attention right after a GEMM that streams 200 MB of weight (an 8B
    gate_up on this step's rows, vexact's kernel), timed as (GEMM + attention) - GEMM in one graph."""
    from vexact_vllm.kernels import linear

    x = torch.randn(q.shape[0], 4096, device=q.device, dtype=q.dtype)
    w = torch.randn(24576, 4096, device=q.device, dtype=q.dtype)
    gemm = bench_graph(lambda: linear(x, w))
    both = bench_graph(lambda: (linear(x, w), attend()))
    print(f"{'after a GEMM':14s} {(both - gemm) * 1000:8.1f}  (GEMM alone {gemm * 1000:.1f} us)")


def _measure(args, q, k_cache, v_cache, block_table, seq_lens, qsl, scale, out):
    from vexact_vllm.kernels import attention_triton, paged_attention

    n_kv, head_dim = k_cache.shape[2], q.shape[2]
    group = q.shape[1] // n_kv
    block_m = attention_triton.forward_config(head_dim, group)[0]
    tiles = attention_triton.tile_count(q.shape[0], seq_lens.shape[0], block_m // group)
    sms = attention_triton._thin_sms(q.device.index) if q.is_cuda else None
    stages = attention_triton.paged_stages(head_dim, tiles * n_kv, sms, False, attention_triton.forward_config(head_dim, group)[2])
    print(f"decode step after {args.steps} tokens: {q.shape[0]} tokens, {seq_lens.shape[0]} sequences, "
          f"{tiles} x {n_kv} programs, {stages} stages")  # fmt: skip
    lens = seq_lens.tolist()
    print(f"  lengths: min {min(lens)} max {max(lens)} mean {sum(lens) / len(lens):.0f}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("qsl", qsl), ("out", out)):  # fmt: skip
        print(_describe(name, t))
    pages = -(-max(lens) // k_cache.shape[1])
    table = block_table[:, :pages]
    steps = (table[:, 1:] - table[:, :-1]).flatten()
    if steps.numel():
        print(f"  page id steps within a row: {(steps == 1).float().mean().item():.2f} consecutive, "
              f"median {steps.median().item()}")  # fmt: skip

    want = paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, scale)
    qc, outc = q.contiguous(), torch.empty_like(want)
    packed = table.contiguous()
    batch, hq, hkv = q.shape[0], q.shape[1], n_kv
    fq, fk, fv, fbt, _, fqsl = _paged_inputs(batch, max(lens), hq, hkv, head_dim, device=q.device, dtype=q.dtype)
    fresh_lens = seq_lens.clone()
    spread = torch.randperm(k_cache.shape[0], device=q.device)[: batch * pages].view(batch, pages).to(torch.int32)
    rows = {
        "engine": lambda: paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, scale, out=out),
        "contiguous q": lambda: paged_attention(qc, k_cache, v_cache, block_table, seq_lens, qsl, scale, out=outc),
        "packed table": lambda: paged_attention(q, k_cache, v_cache, packed, seq_lens, qsl, scale, out=outc),
        "fresh cache": lambda: paged_attention(fq, fk, fv, fbt, fresh_lens, fqsl, scale),
        "spread table": lambda: paged_attention(q, k_cache, v_cache, spread, seq_lens, qsl, scale, out=outc),
    }
    timer = bench_graph if q.is_cuda else _host_ms
    print(f"{'inputs':14s} {'us':>8s}  bits")
    for name, fn in rows.items():
        got = fn()
        same = "-" if name in ("fresh cache", "spread table") else ("same" if torch.equal(got, want) else "DIFFER")
        print(f"{name:14s} {timer(fn) * 1000:8.1f}  {same}", flush=True)
    for keys in (0, 1024, 2048):  # no split and the key splits (other bits: timing only)
        with environment(VEXACT_KEY_SPLIT=str(keys)):
            print(f"{f'split {keys}':14s} {timer(rows['engine']) * 1000:8.1f}  -", flush=True)
    if not q.is_cuda:
        return
    _after_gemm(q, rows["engine"])
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        fa3 = lambda: flash_attn_varlen_func(  # noqa: E731
            q, k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=max(lens), seqused_k=seq_lens,
            softmax_scale=scale, causal=True, block_table=block_table, fa_version=3)  # fmt: skip
        print(f"{'FA3':14s} {bench_graph(fa3) * 1000:8.1f}  (stock's kernel, other bits)")
    except Exception as exc:  # FA3 may refuse the strided views: say so, the rows above stand
        print(f"FA3            not run: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b-shape", help="a built-in model name or checkpoint dir")
    parser.add_argument("--steps", type=int, default=1200, help="tokens decoded before the measured step")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", default="1024-4096", help="prompt lengths, LO-HI (uniform, seed 7)")
    parser.add_argument("--max-model-len", type=int, default=12288, help="as `bench --workload long`")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the hook below sees it
    from vllm import LLM, SamplingParams

    import vexact_vllm.attention as backend
    from vexact_vllm.cli.bench import resolve_model

    calls, state = [0], {"done": False}
    kernel = backend.paged_attention

    def hook(q, k_cache, v_cache, block_table, seq_lens, qsl, scale, out=None, **kw):
        result = kernel(q, k_cache, v_cache, block_table, seq_lens, qsl, scale, out=out, **kw)
        if not state["done"] and q.shape[0] == args.requests == seq_lens.shape[0]:
            calls[0] += 1  # decode steps of all requests, first layer counted per step below
            if calls[0] == args.steps * layers[0] + 1:
                state["done"] = True
                if q.is_cuda:
                    torch.cuda.synchronize()
                _measure(args, q, k_cache, v_cache, block_table, seq_lens, qsl, scale, result)
        return result

    backend.paged_attention = hook
    model = resolve_model(args.model, "dummy")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    layers, vocab = [config.num_hidden_layers], min(config.vocab_size, 30000)
    llm = LLM(model, model_impl="vexact", load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=args.max_model_len, seed=7,
              gpu_memory_utilization=0.8)  # fmt: skip
    lo, hi = (int(x) for x in args.prompt.split("-"))
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))]}
               for _ in range(args.requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=1.0, seed=7, detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    if not state["done"]:
        raise SystemExit(f"no decode step of {args.requests} requests reached step {args.steps}: nothing measured")


if __name__ == "__main__":
    main()
