"""`vexact-vllm bench`: stock vLLM, stock with VLLM_BATCH_INVARIANT=1, and vexact on one workload.

Each engine runs in its own process (VLLM_BATCH_INVARIANT is read at import), on the same model and
the same requests: random prompt token ids with lengths drawn from a range, a fixed number of output
tokens with `ignore_eos`, temperature and seed as given. Prints start-up time (engine ready) and
output tokens/s per configuration, and the ratios to stock. Default workload (../shared/gpu): 256
prompts of 64-511 tokens, 256 output tokens, temperature 1, seed 7, dummy weights.
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


def run_bench(args) -> int:
    if args.config:  # child process
        print("VEXACT_BENCH " + json.dumps(run_one(args)), flush=True)
        return 0
    if args.model is None:
        from vexact_vllm.tiny_model import build_tiny_model

        args.model = str(build_tiny_model("qwen3"))
    args.forward = forward_args(args)
    results = []
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if name not in CONFIGS:
            raise SystemExit(f"error: unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
        cmd = [sys.executable, "-m", "vexact_vllm.cli", "bench", "--config", name, *args.forward]
        env = {**os.environ, **CONFIGS[name]["env"]}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)  # its logs go to our stderr
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VEXACT_BENCH ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"error: configuration {name} failed (exit {proc.returncode}); see its log above")
        results.append(json.loads(line.removeprefix("VEXACT_BENCH ")))
        print(f"{name}: {results[-1]['output_tok_s']:.0f} output tok/s", file=sys.stderr, flush=True)
    base = next((r["output_tok_s"] for r in results if r["config"] == "stock"), None)
    print(f"{'configuration':24s} {'start-up s':>10s} {'output tok/s':>13s} {'vs stock':>9s}")
    for r in results:
        ratio = f"{r['output_tok_s'] / base:.3f}" if base else "-"
        print(f"{r['config']:24s} {r['startup_s']:10.1f} {r['output_tok_s']:13.0f} {ratio:>9s}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "results": results}, f, indent=1)
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="checkpoint directory (default: built-in tiny Qwen3)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", default="64-511", help="prompt length range, inclusive")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--load-format", default="dummy", help="dummy weights are fine for throughput")
    parser.add_argument("--vocab-limit", type=int, default=300, help="prompt token ids are drawn below this")
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
