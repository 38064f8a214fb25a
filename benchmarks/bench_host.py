"""Host (CPU) time per call of what a decode step runs outside its CUDA graph, vexact against stock.

    python benchmarks/bench_host.py [--rows 16,256] [--vocab 151936] [--hidden 2048]

vLLM replays the model's forward as a CUDA graph, but the lm_head and the sampler run eagerly after
it, launched from Python every step. When that host work outlasts the GPU's step, the GPU waits
(a decode-small profile found vexact's engine host-bound and stock's not). Each case is
timed with the GPU held busy by a long sleep kernel queued first, so the loop measures only the
enqueue cost (Python, checks, Triton's launcher), not the kernels: "host us" per call. A case whose
loop outlasts the sleep is marked GPU-bound and its number is not a host time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

CALLS = 40
SLEEP_CYCLES = 400_000_000  # ~0.2 s at H100 clocks: longer than CALLS enqueues of any case here


def host_us(fn, calls: int = CALLS) -> tuple[float, bool]:
    """(microseconds of host time per call, whether the GPU stayed busy for the whole loop)."""
    for _ in range(3):
        fn()  # compile, allocate
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6, host * 1e3 < start.elapsed_time(end)


def profile_calls(name: str, fn, calls: int = 200, top: int = 14) -> None:
    """cProfile's functions with the most own time over `calls` calls of `fn` (host side)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"    cProfile of {name}: own time per call, us")
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    for (file, line, func), (_, ncalls, tottime, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"      {tottime / calls * 1e6:7.1f}  {ncalls // calls:3d}x  {func} ({file.split('/')[-1]}:{line})")


def cases(rows: int, vocab: int, hidden: int):
    """(name, vexact callable, stock callable) for one batch size."""
    from vexact_vllm.kernels import gumbel_argmax, linear, log_softmax

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(vocab, hidden, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    logits = torch.randn(rows, vocab, device=dev, generator=g)
    temperature = torch.full((rows,), 0.9, device=dev)  # requested: the kernels apply the rule
    seeds = torch.arange(rows, device=dev, dtype=torch.int64)
    positions = torch.arange(rows, device=dev, dtype=torch.int64) + 100
    lp = log_softmax(logits, temperature)

    def stock_sample():  # vLLM's shape of work: temperature divide, softmax, exponential draw, argmax
        probs = torch.softmax(logits / temperature[:, None], -1)
        return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)

    def vexact_sample():  # the sampler's work for an all-sampled batch (sampler.rules.draw_tokens)
        return gumbel_argmax(log_softmax(logits, temperature), seeds, positions)

    from vexact_vllm.kernels.gemm.linear_triton import linear_triton
    from vexact_vllm.sampler.graphs import BUCKETS, SamplerGraphs

    with torch.inference_mode():
        yield "lm_head", lambda: linear(h, w, out_dtype=torch.float32), lambda: F.linear(h, w)
        yield "  linear_triton (no autograd)", lambda: linear_triton(h, w, None, torch.float32), None
        yield "log_softmax", lambda: log_softmax(logits, temperature), lambda: torch.log_softmax(logits / temperature[:, None], -1)
        yield "gumbel_argmax", lambda: gumbel_argmax(lp, seeds, positions), lambda: lp.argmax(-1)
        yield "sample (log-probs + draw)", vexact_sample, stock_sample

        def eager_step():  # lm_head + sample, eagerly (what a decode step ran before its graphs)
            return gumbel_argmax(log_softmax(linear(h, w, out_dtype=torch.float32), temperature), seeds, positions)

        def stock_step():
            probs = torch.softmax(F.linear(h, w).float() / temperature[:, None], -1)
            return probs.div_(torch.empty_like(probs).exponential_()).argmax(-1)

        yield "step: lm_head + sample", eager_step, stock_step
        if rows <= BUCKETS[-1]:  # the same step by replays of the sampler graphs (sampler/graphs.py)
            graphs = SamplerGraphs(w, rows)
            graphs.capture()
            idx, at = torch.arange(rows, device=dev, dtype=torch.int32), torch.arange(rows, device=dev)

            def graphed_step():
                graphs.lm_head(h)
                return graphs.sample(rows, "sampled", temperature=temperature, seeds=seeds, req_index=idx,
                                     positions=positions, logits_index=at)  # fmt: skip

            yield "  the step by graph replays", graphed_step, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,256", help="batch sizes (comma-separated)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions per vexact case")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host.py measures CUDA launches: run it on a GPU host")
    print(f"{'rows':>5s}  {'case':28s} {'vexact us':>10s} {'stock us':>9s}  note")
    for rows in (int(r) for r in args.rows.split(",")):
        with torch.inference_mode():
            for name, ours, stock in cases(rows, args.vocab, args.hidden):
                (o, o_ok), (s, s_ok) = host_us(ours), (host_us(stock) if stock else (float("nan"), True))
                note = "" if o_ok and s_ok else "GPU-bound: not a host time"
                print(f"{rows:5d}  {name:28s} {o:10.1f} {s:9.1f}  {note}", flush=True)
                if args.cprofile and not name.startswith(" "):
                    profile_calls(name, ours)


if __name__ == "__main__":
    main()
