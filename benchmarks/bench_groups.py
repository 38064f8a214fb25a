"""What the shared-prompt groups and the thin-step pipelining cost or save, kernel by kernel (CUDA, no
vLLM needed): microseconds of CUDA-graph replays, and whether every variant gives the same bits.

    python3 benchmarks/bench_groups.py

Rows: a step's grouping launch (`shared_prefix_groups`, once a step), and a layer's paged attention
without groups, with them (the prefix launch plus the resuming paged launch), on a step of 256
distinct prompts (no group forms: the `default` workload's decode) and on GRPO's 32 prompts x 8
samples sharing their prompt blocks; then decode at thin batches with the thin-step depth
(`paged_triton.THIN_STAGES`) against 3 stages.
"""

from __future__ import annotations

import os

import torch
from bench_kernels import _paged_inputs, _shared_prefix_inputs, bench_graph

from vexact_vllm.kernels import max_group_members, paged_attention, shared_prefix_groups
from vexact_vllm.kernels.attention import paged_triton

HQ, HKV, D = 16, 8, 128


def _groups_rows(label, groups, samples, prompt, generated):
    q, (kc, vc), _, bt, sl, qsl = _shared_prefix_inputs(groups, samples, prompt, generated, True, HQ, HKV, D)
    scale, most = D**-0.5, max_group_members(D, HQ // HKV)
    buffers = tuple(torch.zeros(sl.shape[0], dtype=torch.int32, device="cuda") for _ in range(5))
    grouping = shared_prefix_groups(bt, sl, qsl, kc.shape[1], most, out=buffers)
    plain = paged_attention(q, kc, vc, bt, sl, qsl, scale)
    same = torch.equal(paged_attention(q, kc, vc, bt, sl, qsl, scale, shared=grouping), plain)
    rows = [
        (label, "grouping (a step)", bench_graph(lambda: shared_prefix_groups(bt, sl, qsl, kc.shape[1], most, out=buffers))),
        (label, "paged, no groups (a layer)", bench_graph(lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale))),
        (label, f"paged with groups (a layer){'' if same else ' BITS DIFFER'}",
         bench_graph(lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale, shared=grouping))),
    ]  # fmt: skip
    return rows, int(grouping.count[0])


def _thin_rows(batch, context):
    q, kc, vc, bt, sl, qsl = _paged_inputs(batch, context, HQ, HKV, D)
    scale = D**-0.5
    own = paged_attention(q, kc, vc, bt, sl, qsl, scale)
    rows = [(f"decode {batch} x {context}", "thin-step depth (own)", bench_graph(lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale)))]
    paged_triton.PAGED_STAGES[D] = 3
    try:
        same = torch.equal(paged_attention(q, kc, vc, bt, sl, qsl, scale), own)
        rows.append((f"decode {batch} x {context}", f"3 stages{'' if same else ' BITS DIFFER'}",
                     bench_graph(lambda: paged_attention(q, kc, vc, bt, sl, qsl, scale))))  # fmt: skip
    finally:
        paged_triton.PAGED_STAGES.pop(D, None)
    return rows


def main():
    rows = []
    for label, args in (("256 distinct prompts", (256, 1, (64, 511), 256)), ("grpo 32 x 8", (32, 8, (256, 1024), 600))):
        found, count = _groups_rows(label, *args)
        rows += [(f"{case} [{count} groups]", what, ms) for case, what, ms in found]
    for batch, context in ((16, 8192), (16, 32768), (32, 6144), (64, 4096)):
        rows += _thin_rows(batch, context)
    print(f"{torch.cuda.get_device_name()}: microseconds, CUDA-graph replays (median)")
    for case, what, ms in rows:
        print(f"  {case:34s} {what:40s} {ms * 1000:9.1f}")


if __name__ == "__main__":
    os.environ["VEXACT_KEY_SPLIT"] = "0"  # the groups take no key split (on by default); read at first use
    main()
