"""Where an engine step's GPU time goes, per category, from `vexact-vllm bench --profile DIR` traces:

    vexact-vllm bench --workload grpo:32 --configs vexact,stock --repeats 1 --duration 0 \
        --warmup-passes 1 --profile DIR --profile-steps 600:20
    python3 benchmarks/profile_steps.py DIR --steps 20 [--top 4]

DIR holds one folder per configuration (the bench's layout), each with the torch-profiler trace(s)
vLLM wrote (`*.pt.trace.json`, gzipped or not). Every GPU kernel, memcpy and memset of the trace is
put in one category by its name (`CATEGORIES`, first match wins; stock's kernels and ours both) and
summed; the table gives microseconds a step (sum / --steps) per configuration, the difference of
each configuration to the first one named by --base (stock by default) and, with --top, the largest
kernels of each category (name and grid: one GEMM kernel serves every weight shape), so that
"other" never hides anything. "busy span" is the first kernel's
start to the last one's end, divided by the steps: the step's GPU time including its idle gaps.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
from collections import defaultdict

# (category, pattern on the kernel name), first match wins. Stock vLLM 0.26 names (FA3, nvjet/cutlass
# GEMMs, its CUDA custom ops, torch.compile's fused Triton kernels, torch's sampler ops) and ours.
CATEGORIES = [
    ("moe", r"moe|_gate_up_kernel|_combine_kernel|_route_kernel|_count_kernel|_scan_kernel|_place_kernel|_grouped"),
    ("kv write", r"reshape_and_cache|_write_kv|concat_and_cache"),
    ("attention", r"flash|_paged_fwd|_fold|_varlen_fwd|_shared_prefix|attend|prepare_varlen"),
    ("rope", r"rotary|_rope|rope_"),
    ("norm", r"rms_norm|rsqrt|_rms"),
    ("silu-and-mul", r"silu|act_and_mul"),
    ("gemm", r"nvjet|gemm|xmma|cutlass|cublas|_linear|matmul|sm90_|wgmma"),
    ("sampler", r"gumbel|_sample|_lse|softmax|argmax|exponential|topk|top_k|sort|_rank_kernel|logprob|"
                r"log_softmax|_pick|max_kernel|reduce_kernel"),
    ("copy/fill", r"memcpy|memset|copy|fill|index|gather|scatter|cat_|elementwise"),
]  # fmt: skip
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORIES]
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def category(name: str) -> str:
    for cat, pattern in _COMPILED:
        if pattern.search(name):
            return cat
    return "other"


def load_events(folder: str) -> list[dict]:
    """The GPU events of every trace file in `folder`."""
    files = sorted(glob.glob(os.path.join(folder, "*.pt.trace.json*")))
    if not files:
        raise SystemExit(f"error: no *.pt.trace.json[.gz] in {folder}: run the bench with --profile {folder}/..")
    events = []
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            trace = json.load(f)
        events += [e for e in trace.get("traceEvents", []) if e.get("cat") in _GPU_CATS and "dur" in e]
    return events


def summarise(events: list[dict], steps: int) -> dict:
    """{category: us a step}, plus the busy span a step and each category's kernels by total time."""
    per_cat: dict[str, float] = defaultdict(float)
    kernels: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in events:
        cat = category(e["name"])
        per_cat[cat] += e["dur"]
        grid = e.get("args", {}).get("grid")  # one GEMM kernel serves every weight shape: split by grid
        k = kernels[cat][e["name"] + (f" grid={grid}" if grid else "")]
        k[0] += e["dur"]
        k[1] += 1
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) if events else 0.0
    return {
        "us": {c: t / steps for c, t in per_cat.items()},
        "sum": sum(per_cat.values()) / steps,
        "span": span / steps,
        "kernels": kernels,
        "steps": steps,
    }


def _short(name: str, width: int = 90) -> str:
    name = re.sub(r"<.*>", "<..>", name)
    return name if len(name) <= width else name[: width - 2] + ".."


def table(results: dict[str, dict], base: str, top: int) -> str:
    configs = list(results)
    cats = [c for c, _ in CATEGORIES] + ["other"]
    cats = [c for c in cats if any(c in r["us"] for r in results.values())]
    head = f"{'us a step':<16}" + "".join(f"{c:>14}" for c in configs)
    others = [c for c in configs if base in results and c != base]
    head += "".join(f"{c + ' - ' + base:>24}" for c in others)
    lines = [head]

    def row(label: str, values: dict[str, float]) -> str:
        text = f"{label:<16}" + "".join(f"{values[c]:>14.1f}" for c in configs)
        return text + "".join(f"{values[c] - values[base]:>+24.1f}" for c in others)

    for cat in cats:
        lines.append(row(cat, {c: results[c]["us"].get(cat, 0.0) for c in configs}))
    lines.append(row("sum of kernels", {c: results[c]["sum"] for c in configs}))
    lines.append(row("busy span", {c: results[c]["span"] for c in configs}))
    if top:
        for c in configs:
            lines.append(f"\n{c}: largest kernels of each category (us a step, calls a step)")
            steps = results[c]["steps"]
            for cat in cats:
                ranked = sorted(results[c]["kernels"][cat].items(), key=lambda kv: -kv[1][0])[:top]
                for name, (total, calls) in ranked:
                    lines.append(f"  {cat:<13} {total / steps:>9.1f} {calls / steps:>6.1f}  {_short(name)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the bench's --profile DIR (one folder per configuration)")
    parser.add_argument("--steps", type=int, required=True, help="engine steps profiled (--profile-steps' second number)")
    parser.add_argument("--base", default="stock", help="the configuration the others are compared with")
    parser.add_argument("--top", type=int, default=0, help="also list each category's N largest kernels")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    folders = sorted(d for d in glob.glob(os.path.join(args.dir, "*")) if os.path.isdir(d))
    if not folders:
        raise SystemExit(f"error: no configuration folders in {args.dir}")
    results = {os.path.basename(d): summarise(load_events(d), args.steps) for d in folders}
    if args.base in results:  # the base first
        results = {args.base: results.pop(args.base), **results}
    print(table(results, args.base, args.top))


if __name__ == "__main__":
    main()
