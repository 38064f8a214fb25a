"""The q/k norm + RoPE launch with 1, 2, 4 and 8 heads a program (`rope_triton.HEADS_PER_PROGRAM`,
speed only: the bits are checked equal to one head a program), against the same math compiled by
Inductor alone (`bench_kernels._rope_native`). CUDA, no vLLM needed; microseconds of CUDA-graph
replays, one line per shape.

    python3 benchmarks/sweep_rope_heads.py
"""

from __future__ import annotations

import torch
from bench_kernels import _rope_inputs, _rope_native, bench_graph

from vexact_vllm.kernels import rope_triton

SHAPES = (("8B", 32, 8, 16), ("8B", 32, 8, 64), ("8B", 32, 8, 128), ("8B", 32, 8, 256), ("8B", 32, 8, 8192),
          ("1.7B", 16, 8, 64), ("1.7B", 16, 8, 256))  # model, Hq, Hkv, T


def main():
    print(torch.cuda.get_device_name())
    compiled = torch.compile(_rope_native, fullgraph=True, dynamic=False)
    saved = rope_triton.HEADS_PER_PROGRAM, rope_triton._FEW_PROGRAMS
    rope_triton._FEW_PROGRAMS = 0  # every launch takes HEADS_PER_PROGRAM as set
    try:
        for model, hq, hkv, t in SHAPES:
            print("  ".join(_row(compiled, model, hq, hkv, t)), "(us)", flush=True)
    finally:
        rope_triton.HEADS_PER_PROGRAM, rope_triton._FEW_PROGRAMS = saved


def _row(compiled, model, hq, hkv, t):
    q, k, positions, cache, w = _rope_inputs(t, hq, hkv)

    def ours():
        return rope_triton.apply_rope_triton(q, k, positions, cache, (w, w, 1e-6))

    row, first = [f"{model} T={t}"], None
    for heads in (1, 2, 4, 8):
        rope_triton.HEADS_PER_PROGRAM = heads
        out = ours()
        first = out if first is None else first
        same = all(torch.equal(a, b) for a, b in zip(out, first))
        row.append(f"H{heads} {bench_graph(ours) * 1000:6.2f}{'' if same else ' DIFF'}")
    cos_sin = cache.to(torch.bfloat16)
    row.append(f"inductor {bench_graph(lambda: compiled(q, k, positions, cos_sin, w, w)) * 1000:6.2f}")
    return row


if __name__ == "__main__":
    main()
