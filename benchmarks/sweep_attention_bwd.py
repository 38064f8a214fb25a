"""Time the training attention backward under other launch configurations (CUDA).

    python benchmarks/sweep_attention_bwd.py [--cases 8x1024,4x4096,2x16384] [--out DIR]

The backward needs to be deterministic, not batch-invariant (DESIGN rule 7), so its tiles and warps
are free: this times forward + backward of `varlen_attention` (Qwen3-1.7B heads: 16 / 8 of 128) for
each (dK/dV, dQ) configuration in CONFIGS against the current `_BWD_CONFIGS`, next to torch SDPA
(flash), and checks every configuration's gradients against the current one's (bf16 tolerance; they
sum in other orders). `benchmarks/inspect_sass.py` shows the current 4-warp configurations spill on
sm_90a (255 registers); the 8-warp ones do not.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from vexact_vllm.kernels import (
    attention_triton,  # noqa: F401 (first: it imports the backward module, which imports it)
    varlen_attention,
)
from vexact_vllm.kernels import attention_triton_bwd as bwd

# (dK/dV config, dQ config): (BLOCK_M, BLOCK_N, num_warps, num_stages) each; the first is the current one.
CONFIGS = [
    bwd._BWD_CONFIGS[128],
    ((64, 64, 8, 2), (128, 32, 8, 3)),
    ((128, 32, 8, 2), (128, 32, 8, 3)),
    ((64, 64, 8, 2), (128, 64, 8, 2)),
    ((64, 32, 4, 2), (64, 32, 4, 3)),
]


def _inputs(nseq: int, length: int):
    t = nseq * length
    q, k, v = (
        torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (16, 8, 8)
    )
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.int32)
    return q, k, v, cu, torch.randn(t, 16, 128, device="cuda", dtype=torch.bfloat16)


def _ours(q, k, v, cu, grad):
    for t in (q, k, v):
        t.grad = None
    varlen_attention(q, k, v, cu, 128**-0.5).backward(grad)
    return q.grad, k.grad, v.grad


def _sdpa(q, k, v, nseq, length, grad):
    shape = lambda x: x.view(nseq, length, x.shape[1], 128).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(shape(q), shape(k), shape(v), is_causal=True, enable_gqa=True)
    out.backward(shape(grad))


def _time_case(case: str, rows: list[dict]) -> None:
    from triton.testing import do_bench

    nseq, length = (int(x) for x in case.split("x"))
    q, k, v, cu, grad = _inputs(nseq, length)
    sdpa = do_bench(lambda: _sdpa(q, k, v, nseq, length, grad))
    reference = [g.clone() for g in _ours(q, k, v, cu, grad)]
    for cfg in CONFIGS:
        bwd._BWD_CONFIGS[128] = cfg
        grads = _ours(q, k, v, cu, grad)
        error = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference))
        ms = do_bench(lambda: _ours(q, k, v, cu, grad))
        rows.append({"case": case, "config": cfg, "ms": ms, "sdpa_ms": sdpa, "max_grad_diff": error})
        print(f"{case:10s} dkdv {cfg[0]} dq {cfg[1]}: {ms:8.3f}  vs SDPA {sdpa / ms:5.2f}  "
              f"max |grad - current| {error:.3g}", flush=True)  # fmt: skip
    bwd._BWD_CONFIGS[128] = CONFIGS[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="8x1024,4x4096,2x16384")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    print(f"{torch.cuda.get_device_name()}: varlen attention fwd+bwd (ms), Hq 16, Hkv 8, D 128, bf16")
    for case in args.cases.split(","):
        _time_case(case, rows)
    with open(os.path.join(args.out, "attention_bwd.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
