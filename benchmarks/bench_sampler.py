"""The fused sampling step (`kernels.sample_tokens`) against the composition it replaced, on one GPU.

    python benchmarks/bench_sampler.py [--rows 1,16,64,256,512] [--vocab 151936] [--out DIR]

Per row count, draw and output, both timed as CUDA-graph replays (as the decode step runs them):
"composition" is what the sampler launched before (`kernels.sampling.sample.sample_composed` on CUDA
tensors): log_softmax written to [B, V], then argmax or gumbel_argmax reading it, then (output
"token_log_probs") the token's log-prob gathered and its rank counted by torch
(`(log_probs >= token_lp).sum(-1)`, standing in for vLLM's rank kernel, which also reads the row once). "fused" is `sample_tokens(..., draw=, output=)`. Greedy against sampled shows
what the Gumbel noise costs. The `equal` column checks the two give the same bits. Full numbers to
DIR/sampler.json; the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _time_graph(fn) -> float:
    from triton.testing import do_bench_cudagraph

    from vexact_vllm.kernels.capture import gc_paused

    fn()
    with gc_paused():
        return 1e3 * float(do_bench_cudagraph(fn, rep=50, return_mode="median"))  # us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256,512")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from vexact_vllm.kernels import Sampled, sample_tokens
    from vexact_vllm.kernels.sampling.sample import (
        sample_composed,  # the composition, each op by its own kernel
    )

    torch.manual_seed(0)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = torch.randn(rows, args.vocab, device="cuda") * 4
        seeds = torch.randint(0, 2**62, (rows,), device="cuda")
        positions = torch.randint(0, 30000, (rows,), device="cuda")
        for draw in ("greedy", "sampled"):
            tau = torch.zeros(rows, device="cuda") if draw == "greedy" else torch.full((rows,), 0.9, device="cuda")
            for output in ("tokens", "token_log_probs", "log_probs"):
                new = sample_tokens(logits, tau, seeds, positions, draw=draw, output=output)
                old = Sampled(*(None if t is None else torch.empty_like(t) for t in new))
                inputs = (logits, tau, seeds, positions)
                sample_composed(*inputs, draw, output, old)
                equal = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(old, new))
                t_old = _time_graph(lambda i=inputs, d=draw, o=output, b=old: sample_composed(*i, d, o, b))
                t_new = _time_graph(lambda i=inputs, d=draw, o=output: sample_tokens(*i, draw=d, output=o))
                results.append(dict(rows=rows, draw=draw, output=output, composition_us=t_old, fused_us=t_new,
                                    speedup=t_old / t_new, equal=equal))  # fmt: skip
                print(results[-1], flush=True)
    with open(os.path.join(args.out, "sampler.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "vocab": args.vocab, "rows": results}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, vocab {args.vocab}, us per call (CUDA-graph replay)")
    print("rows  draw     output           composition    fused   speedup  equal")
    for r in results:
        print(f"{r['rows']:4d}  {r['draw']:7s}  {r['output']:15s}  {r['composition_us']:11.1f}  {r['fused_us']:7.1f}"
              f"  {r['speedup']:7.2f}  {'yes' if r['equal'] else 'NO'}")


if __name__ == "__main__":
    main()
