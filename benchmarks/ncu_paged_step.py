"""One decode step's attention, launched a few times, for Nsight Compute (CUDA, no vLLM needed):

    ncu --kernel-name regex:"_paged_fwd|_fold" --launch-skip 4 --launch-count 4 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python3 benchmarks/ncu_paged_step.py [--shape 8B] [--step mixed|uniform|tail]

Steps (sweep_paged_depth.py's): `mixed`, 16 sequences spread evenly over 2,200-5,200 keys (the 8B
`long:16` decode); `uniform`, 16 x 5,200; `tail`, 8 rows of 1,000-9,000. With VEXACT_KEY_SPLIT set,
the launches are split decode's (chunks, then the fold kernel).
"""

from __future__ import annotations

import argparse

import torch
from sweep_paged_depth import MIXED, SHAPES, D, _caches

from vexact_vllm.kernels import paged_attention

STEPS = {"mixed": (16, MIXED[1], MIXED), "uniform": (16, MIXED[1], None), "tail": (8, 9000, (1000, 9000))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8B", choices=sorted(SHAPES))
    parser.add_argument("--step", default="mixed", choices=sorted(STEPS))
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    hq, hkv = SHAPES[args.shape]
    batch, context, lengths = STEPS[args.step]
    q, bt, sl, qsl, [(kc, vc)] = _caches(batch, context, hq, hkv, 1, True)
    if lengths is not None:
        sl = torch.linspace(*lengths, batch, device="cuda").round().int()
    for _ in range(args.calls):
        paged_attention(q, kc, vc, bt, sl, qsl, D**-0.5)
    torch.cuda.synchronize()
    print(f"{args.shape} {args.step}: {args.calls} calls on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
