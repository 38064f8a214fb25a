"""The paged kernel's pipelining depth at decode, per model shape (CUDA, no vLLM needed): microseconds
of CUDA-graph replays of one layer's decode attention at each depth, the depth the kernel picks itself
(`attention_triton.paged_stages`), and whether every depth gives the same bits (it must: speed only).

    python3 benchmarks/sweep_paged_depth.py [--stages 3,4,5,6,7]

Shapes: Qwen3-1.7B (16 query heads, 8 kv heads) and Qwen3-8B (32, 8), head dim 128, pages of 16 on a
shuffled block table, every sequence at the same context.
"""

from __future__ import annotations

import argparse

import torch
from bench_kernels import _paged_inputs, bench_graph

from vexact_vllm.kernels import attention_triton, paged_attention

D = 128
SHAPES = {"1.7B": (16, 8), "8B": (32, 8)}
STEPS = ((16, 2048), (16, 4096), (16, 8192), (16, 32768), (32, 4096), (64, 4096))


def _row(hq, hkv, batch, context, depths):
    q, kc, vc, bt, sl, qsl = _paged_inputs(batch, context, hq, hkv, D)
    run = lambda: paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5)  # noqa: E731
    own = run()
    times, same = {"own": bench_graph(run)}, True
    for stages in depths:
        attention_triton._PAGED_STAGES[D] = stages
        try:
            same &= torch.equal(run(), own)
            times[stages] = bench_graph(run)
        finally:
            attention_triton._PAGED_STAGES.pop(D, None)
    return times, same


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="3,4,5,6,7", help="depths to time, comma-separated")
    depths = [int(s) for s in parser.parse_args().stages.split(",")]
    print(f"{torch.cuda.get_device_name()}: microseconds a layer, CUDA-graph replays (median)")
    print(f"{'shape':6s} {'step':12s} {'own':>7s}" + "".join(f" {f'{s} st':>7s}" for s in depths) + "  bits")
    for name, (hq, hkv) in SHAPES.items():
        for batch, context in STEPS:
            times, same = _row(hq, hkv, batch, context, depths)
            cells = "".join(f" {times[s] * 1000:7.1f}" for s in depths)
            print(f"{name:6s} {f'{batch} x {context}':12s} {times['own'] * 1000:7.1f}{cells}  {'same' if same else 'DIFFER'}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
