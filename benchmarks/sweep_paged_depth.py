"""The paged kernel's pipelining depth at decode, per model shape (CUDA, no vLLM needed): microseconds
of CUDA-graph replays of one layer's decode attention at each depth, the depth the kernel picks itself
(`attention_triton.paged_stages`), and whether every depth gives the same bits (it must: speed only).

    python3 benchmarks/sweep_paged_depth.py [--stages 3,4,5,6,7] [--mixed] [--fa4] [--layers N] [--vllm-layout]

--layers N attends N distinct caches in turn in each replay, as an engine step's layers do: no K/V
is left in L2 from the previous call. --vllm-layout stores K and V as views of one
[blocks, Hkv, page, 2D] cache, as vexact's vLLM backend does. --mixed adds steps of 16 sequences whose
lengths spread evenly over 2,200-5,200 keys (the 8B `long:16` profile's decode), beside uniform steps
at their mean and at their longest. --fa4 adds FlashAttention-4's time on each step
(VEXACT_ATTENTION=fa4, one torch.cuda.graph capture replayed); it needs flash-attn-4 on an SM90 GPU.
Our kernel's columns are the split launches unless VEXACT_KEY_SPLIT=0 (2,048 keys when unset; FA4
runs unsplit).

Shapes: Qwen3-1.7B (16 query heads, 8 kv heads) and Qwen3-8B (32, 8), head dim 128, pages of 16 on a
shuffled block table, every sequence at the same context.
"""

from __future__ import annotations

import argparse

import torch
from bench_kernels import _paged_inputs, bench_graph, bench_one_capture, environment

from vexact_vllm.kernels import attention_triton, paged_attention

D = 128
SHAPES = {"1.7B": (16, 8), "8B": (32, 8)}
STEPS = ((16, 2048), (16, 4096), (16, 8192), (16, 32768), (32, 4096), (64, 4096))


MIXED = (2200, 5200)
# A rollout's tail: few rows left, long and uneven (where one program a row leaves most SMs idle).
TAILS = ((4, 8192, None), (8, 9000, (1000, 9000)))


def _caches(batch, context, hq, hkv, layers, vllm_layout):
    """q, block table, lengths, query starts, and `layers` distinct (K, V) caches on that table."""
    caches = []
    for _ in range(layers):
        q, kc, vc, bt, sl, qsl = _paged_inputs(batch, context, hq, hkv, D)
        if vllm_layout:  # vexact's vLLM cache: [blocks, Hkv, page, 2D], K and V as strided views
            kv = torch.cat([kc.transpose(1, 2), vc.transpose(1, 2)], -1)
            kc, vc = kv.transpose(1, 2)[..., :D], kv.transpose(1, 2)[..., D:]
        caches.append((kc, vc))
    return q, bt, sl, qsl, caches


def _row(hq, hkv, batch, context, depths, lengths=None, fa4=False, layers=1, vllm_layout=False):
    """us a layer at each depth. With layers > 1 one replay attends `layers` distinct caches in turn,
    as an engine step's layers do, so no layer finds the previous one's K/V in L2."""
    q, bt, sl, qsl, caches = _caches(batch, context, hq, hkv, layers, vllm_layout)
    if lengths is not None:
        sl = torch.linspace(*lengths, batch, device="cuda").round().int()

    def run():
        return [paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5) for kc, vc in caches][-1]

    own = run()
    times, same = {"own": bench_graph(run) / layers}, True
    if fa4:
        with environment(VEXACT_KEY_SPLIT=None, VEXACT_ATTENTION="fa4"):  # FA4 takes no split: timed without it
            times["fa4"] = bench_one_capture(run) / layers  # one capture: see bench_one_capture
    for stages in depths:
        attention_triton._PAGED_STAGES[D] = stages
        try:
            same &= torch.equal(run(), own)
            times[stages] = bench_graph(run) / layers
        finally:
            attention_triton._PAGED_STAGES.pop(D, None)
    return times, same


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="3,4,5,6,7", help="depths to time, comma-separated")
    parser.add_argument("--mixed", action="store_true", help="only the mixed-length steps, their references and "
                        "rollout tails (few long rows)")  # fmt: skip
    parser.add_argument("--fa4", action="store_true", help="also time FlashAttention-4 (SM90, flash-attn-4)")
    parser.add_argument("--vllm-layout", action="store_true", help="K/V as views of one [blocks, Hkv, page, 2D] cache")
    parser.add_argument("--layers", type=int, default=1, help="distinct caches attended in turn a replay (cold L2)")
    args = parser.parse_args()
    depths = [int(s) for s in args.stages.split(",")]
    mean = sum(MIXED) // 2
    mixed = [(16, MIXED[1], MIXED), (16, mean, None), (16, MIXED[1], None), *TAILS]
    steps = mixed if args.mixed else [(*s, None) for s in STEPS]
    print(f"{torch.cuda.get_device_name()}: microseconds a layer, CUDA-graph replays (median)")
    print(f"{'shape':6s} {'step':18s} {'own':>7s}" + "".join(f" {f'{s} st':>7s}" for s in depths)
          + (f" {'FA4':>7s}" if args.fa4 else "") + "  bits")  # fmt: skip
    for name, (hq, hkv) in SHAPES.items():
        for batch, context, lengths in steps:
            times, same = _row(hq, hkv, batch, context, depths, lengths, args.fa4, args.layers, args.vllm_layout)
            cells = "".join(f" {times[s] * 1000:7.1f}" for s in depths) + (f" {times['fa4'] * 1000:7.1f}" if args.fa4 else "")
            step = f"{batch} x {lengths[0]}-{lengths[1]}" if lengths else f"{batch} x {context}"
            print(f"{name:6s} {step:18s} {times['own'] * 1000:7.1f}{cells}  {'same' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
