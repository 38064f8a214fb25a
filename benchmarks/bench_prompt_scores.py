"""Prompt scoring throughput (a teacher's `prompt_logprobs`): vexact against stock vLLM.

    python benchmarks/bench_prompt_scores.py [--model qwen3-8b-shape] [--top-k 0,5] [--output FILE]
    python benchmarks/bench_prompt_scores.py --small     # CPU smoke run: the tiny Qwen3, a few prompts

Each configuration (stock, vexact) runs in its own process with one engine: dummy weights for the
shape stand-ins, 256 sequences of 1,024-2,048 random token ids (seeded), one output token each, and
`prompt_logprobs=K` for every K of --top-k. One untimed pass, then timed passes until --duration
seconds; the figure is scored prompt tokens (P - 1 per sequence) per second. A table prints last;
--output gets every number as JSON lines in docs/results.jsonl's fields (date, device, commit,
command, metric, value), and each child's whole output beside it (OUTPUT's stem + .stock.log, .vexact.log).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def sequences(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_config(args) -> None:
    """The child: one engine (stock or vexact), every K timed; one JSON line per K on stdout."""
    from vllm import LLM, SamplingParams

    from vexact_vllm import MODEL_IMPL
    from vexact_vllm.cli.rollout import shutdown_engine
    from vexact_vllm.tiny_model import builtin_model

    path = builtin_model(args.model, weights=args.load_format != "dummy")
    impl = {"model_impl": MODEL_IMPL} if args.config == "vexact" else {}
    llm = LLM(path, dtype="bfloat16", load_format=args.load_format, skip_tokenizer_init=True, seed=0,
              max_model_len=args.max_len + 8, **impl, **json.loads(args.engine_kwargs))  # fmt: skip
    vocab = min(llm.llm_engine.model_config.get_vocab_size(), args.vocab_limit)
    seqs = sequences(args.num_sequences, args.min_len, args.max_len, vocab, args.seed)
    prompts = [{"prompt_token_ids": s} for s in seqs]
    scored = sum(len(s) - 1 for s in seqs)
    for k in args.top_k:
        params = SamplingParams(max_tokens=1, temperature=1.0, seed=1, prompt_logprobs=k, detokenize=False)
        llm.generate(prompts, params, use_tqdm=False)  # untimed: compilation, graphs, allocator
        passes = []
        deadline = time.perf_counter() + args.duration
        while not passes or time.perf_counter() < deadline:
            llm.reset_prefix_cache()
            t = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            passes.append(time.perf_counter() - t)
            assert all(len(o.prompt_logprobs) == len(s) for o, s in zip(out, seqs))
        rates = [scored / s for s in passes]
        print("RESULT " + json.dumps({"config": args.config, "top_k": k, "scored_tokens": scored,
                                      "passes": len(passes), "tok_s": statistics.median(rates),
                                      "min": min(rates), "max": max(rates)}), flush=True)  # fmt: skip
    shutdown_engine(llm)  # the engine core stopped before the interpreter exits (else a C++ abort at teardown)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()})"


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b-shape", help="a built-in model (vexact_vllm.tiny_model)")
    p.add_argument("--configs", default="stock,vexact")
    p.add_argument("--top-k", type=lambda t: [int(x) for x in t.split(",")], default=[0, 5])
    p.add_argument("--num-sequences", type=int, default=256)
    p.add_argument("--min-len", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--vocab-limit", type=int, default=151_643, help="ids drawn below this and the vocabulary")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--engine-kwargs", default="{}", help="JSON of extra LLM(...) arguments")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--output", help="JSON lines for docs/results.jsonl")
    p.add_argument("--small", action="store_true", help="CPU smoke run")
    p.add_argument("--config", help=argparse.SUPPRESS)  # set for the child
    args = p.parse_args(argv)
    if args.small:
        args.model, args.num_sequences, args.min_len, args.max_len, args.duration = (
            "tiny-qwen3",
            3,
            20,
            40,
            0.0,
        )
        args.load_format = "auto"
        args.engine_kwargs = json.dumps({"kv_cache_memory_bytes": 64 << 20, **json.loads(args.engine_kwargs)})
    if args.config:
        run_config(args)
        return 0
    rows = []
    for config in args.configs.split(","):
        child = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--small"]
        if args.small:
            child += ["--model", args.model, "--num-sequences", str(args.num_sequences), "--min-len",
                      str(args.min_len), "--max-len", str(args.max_len), "--duration", "0", "--load-format", "auto",
                      "--engine-kwargs", args.engine_kwargs]  # fmt: skip
        cmd = [sys.executable, __file__, *child, "--config", config]
        began = time.perf_counter()
        log = Path(args.output).with_suffix(f".{config}.log") if args.output else None
        if log is not None:  # the child's whole output, written as it runs (kept if the run is killed)
            with open(log, "w") as f:
                proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
            output = log.read_text()
        else:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            output = proc.stdout
        found = [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]
        print(f"{config}: {time.perf_counter() - began:.0f} s, exit {proc.returncode}", file=sys.stderr, flush=True)
        if {r["top_k"] for r in found} != set(args.top_k):
            print(output[-6000:], file=sys.stderr)
            raise SystemExit(f"{config}: the run failed (exit {proc.returncode}){f'; its log: {log}' if log else ''}")
        if proc.returncode:  # every figure reported, then a failure on the way out
            print(f"warning: {config} exited {proc.returncode} after reporting every figure", file=sys.stderr)
        rows += found
    stock = {r["top_k"]: r["tok_s"] for r in rows if r["config"] == "stock"}
    print(f"{'config':<8} {'top-k':>5} {'scored tok/s':>13} {'min':>10} {'max':>10} {'x stock':>8}")
    for r in rows:
        ratio = f"{r['tok_s'] / stock[r['top_k']]:.3f}" if r["top_k"] in stock else "-"
        print(
            f"{r['config']:<8} {r['top_k']:>5} {r['tok_s']:>13.0f} {r['min']:>10.0f} {r['max']:>10.0f} {ratio:>8}"
        )
    if args.output:
        with open(args.output, "w") as f:
            for k in sorted({r["top_k"] for r in rows}):
                mine = {r["config"]: r for r in rows if r["top_k"] == k}
                value = ", ".join(f"{c} {r['tok_s']:.0f}" for c, r in mine.items())
                if "vexact" in mine and "stock" in mine:
                    value += f" ({mine['vexact']['tok_s'] / mine['stock']['tok_s']:.3f}x stock)"
                f.write(json.dumps({
                    "id": f"prompt-scores-k{k}", "section": "Prompt scoring", "date": datetime.date.today().isoformat(),
                    "title": f"prompt_logprobs={k} scoring throughput, {args.model}",
                    "device": device_name(), "commit": commit(), "command": " ".join(["python", *sys.argv]),
                    "metric": "scored prompt tokens per second (median of passes)", "value": value,
                    "notes": f"{args.num_sequences} sequences of {args.min_len}-{args.max_len} tokens, one output token",
                }) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
