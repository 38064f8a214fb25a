"""`vexact-vllm bench`: stock vLLM, stock with VLLM_BATCH_INVARIANT=1, and vexact on one workload.

Each engine runs in its own process (VLLM_BATCH_INVARIANT is read at import), on the same model and
the same requests: random prompt token ids with lengths drawn from a range, a fixed number of output
tokens with `ignore_eos`, temperature and seed as given. Prints start-up time (engine ready) and
output tokens/s per configuration, their ratios to stock, and vexact's to stock-batch-invariant.
All three run by default; without CUDA, stock-batch-invariant is left out (vLLM's batch-invariant
mode is Triton kernels). A configuration that fails is reported and the others still run (exit 1).

Default workload (the one ../shared/gpu reports stock vLLM on): the built-in `qwen3-1.7b-shape`
(Qwen3-1.7B's config, 28 layers, hidden 2048, 16/8 heads of 128, vocabulary 151936) with dummy
weights (only its config is written: `--load-format dummy` never reads weights), 256 prompts of
64-511 random token ids below the vocabulary size, 256 output tokens, temperature 1, seed 7,
CUDA graphs on (vLLM's default). One 8-request warm-up generate before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = {
    "stock": {"model_impl": "vllm", "env": {}},
    "stock-batch-invariant": {"model_impl": "vllm", "env": {"VLLM_BATCH_INVARIANT": "1"}},
    "vexact": {"model_impl": "vexact", "env": {}},
}


def _requests(args) -> list[list[int]]:
    import random

    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.input_len.split("-"))
    return [[rng.randrange(10, args.vocab_limit) for _ in range(rng.randint(lo, hi))] for _ in range(args.num_prompts)]


def run_one(args) -> dict:
    """One configuration in this process; returns its measurements."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        args.model, model_impl=CONFIGS[args.config]["model_impl"], dtype=args.dtype, seed=args.seed,
        load_format=args.load_format, skip_tokenizer_init=True, max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager, **json.loads(args.engine_kwargs),
    )  # fmt: skip
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p in _requests(args)]
    params = [
        SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature, seed=args.seed + i,
                       detokenize=False)
        for i in range(len(prompts))
    ]  # fmt: skip
    llm.generate(prompts[: min(8, len(prompts))], params[:8], use_tqdm=False)  # warm-up
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t1
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"config": args.config, "startup_s": startup, "elapsed_s": elapsed, "output_tokens": tokens,
            "output_tok_s": tokens / elapsed}


def resolve_model(name: str, load_format: str) -> str:
    """A checkpoint directory, or a built-in name (without weights when they are dummy)."""
    from pathlib import Path

    from vexact_vllm.tiny_model import BUILTIN_MODELS, builtin_model

    if name in BUILTIN_MODELS:
        return str(builtin_model(name, weights=load_format != "dummy"))
    if not (Path(name) / "config.json").is_file():
        raise SystemExit(f"error: {name} is neither a checkpoint directory nor a built-in model "
                         f"({', '.join(BUILTIN_MODELS)})")  # fmt: skip
    return name


def _vocab_size(model: str) -> int:
    from pathlib import Path

    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def default_configs() -> list[str]:
    """All of them on CUDA. Elsewhere not stock-batch-invariant: vLLM's batch-invariant kernels are
    Triton kernels (it can still be asked for)."""
    import torch

    return [c for c in CONFIGS if c != "stock-batch-invariant" or torch.cuda.is_available()]


def to_table(results: list[dict]) -> str:
    """Start-up and throughput per configuration, with their ratios to stock (and vexact's to
    stock-batch-invariant). A configuration that failed has `failed` set and no numbers."""
    ok = {r["config"]: r for r in results if not r.get("failed")}
    base, bi = ok.get("stock", {}), ok.get("stock-batch-invariant", {})
    header = (f"{'configuration':24s} {'start-up s':>10s} {'vs stock':>9s} {'output tok/s':>13s} {'vs stock':>9s} "
              f"{'vs BI':>7s}")  # fmt: skip
    lines = [header]
    for r in results:
        if r.get("failed"):
            lines.append(f"{r['config']:24s} failed: {r['failed']}")
            continue
        vs_bi = _ratio(r["output_tok_s"], bi.get("output_tok_s")) if r["config"] == "vexact" else ""
        lines.append(
            f"{r['config']:24s} {r['startup_s']:10.1f} {_ratio(r['startup_s'], base.get('startup_s')):>9s} "
            f"{r['output_tok_s']:13.0f} {_ratio(r['output_tok_s'], base.get('output_tok_s')):>9s} {vs_bi:>7s}".rstrip()
        )
    lines.append("vs stock: this configuration / stock; vs BI: vexact / stock-batch-invariant "
                 "(start-up: lower is better; tok/s: higher is better)")  # fmt: skip
    return "\n".join(lines)


def run_bench(args) -> int:
    if args.config:  # child process
        print("VEXACT_BENCH " + json.dumps(run_one(args)), flush=True)
        return 0
    if args.configs is None:
        names = default_configs()
        if len(names) < len(CONFIGS):
            print("note: no CUDA: leaving out stock-batch-invariant (VLLM_BATCH_INVARIANT needs Triton)",
                  file=sys.stderr)  # fmt: skip
    else:
        names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    model_name = args.model
    args.model = resolve_model(args.model, args.load_format)
    if args.vocab_limit is None:
        args.vocab_limit = _vocab_size(args.model)
    args.forward = forward_args(args)
    results = []
    for name in names:  # a failure is reported and the others still run: each can take minutes
        cmd = [sys.executable, "-m", "vexact_vllm.cli", "bench", "--config", name, *args.forward]
        env = {**os.environ, **CONFIGS[name]["env"]}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)  # its logs go to our stderr
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VEXACT_BENCH ")), None)
        if proc.returncode != 0 or line is None:
            results.append({"config": name, "failed": f"exit {proc.returncode}, see its log on stderr"})
            print(f"error: configuration {name} failed (exit {proc.returncode}); see its log above",
                  file=sys.stderr, flush=True)  # fmt: skip
            continue
        results.append(json.loads(line.removeprefix("VEXACT_BENCH ")))
        print(f"{name}: {results[-1]['output_tok_s']:.0f} output tok/s, start-up {results[-1]['startup_s']:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    workload = (f"{model_name} ({args.load_format} weights), {args.num_prompts} prompts of {args.input_len} tokens, "
                f"{args.output_len} output tokens, temperature {args.temperature}, seed {args.seed}"
                f"{', eager' if args.enforce_eager else ''}")  # fmt: skip
    print(workload)
    print(to_table(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "model_name": model_name, "workload": workload,
                       "forwarded": args.forward, "results": results}, f, indent=1)  # fmt: skip
    return 1 if any(r.get("failed") for r in results) else 0


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="qwen3-1.7b-shape",
                        help="checkpoint directory, or a built-in model: qwen3-1.7b-shape (the default; only its "
                        "config is written when --load-format is dummy), qwen3-8b-shape, tiny-qwen3, tiny-qwen2, "
                        "tiny-llama")
    parser.add_argument("--configs", help=f"comma-separated subset of {', '.join(CONFIGS)} (default: all; "
                        "stock-batch-invariant only on CUDA)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="64-511", help="prompt length range, inclusive")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--load-format", default="dummy", help="dummy weights are fine for throughput")
    parser.add_argument("--vocab-limit", type=int,
                        help="prompt token ids are drawn from [10, this) (default: the model's vocab_size)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--engine-kwargs", default="{}", help="JSON of extra LLM(...) arguments")
    parser.add_argument("--output", help="write the results as JSON")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # set for the per-configuration child


FORWARDED = ("model", "num_prompts", "input_len", "output_len", "temperature", "seed", "dtype", "max_model_len",
             "load_format", "vocab_limit", "enforce_eager", "engine_kwargs")


def forward_args(args) -> list[str]:
    """The child's command line: the parent's workload options (the model resolved)."""
    out = []
    for name in FORWARDED:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif value is not None:
            out += [flag, str(value)]
    return out
