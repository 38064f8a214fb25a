"""`vexact-vllm check`: generate with vLLM + the plugin, recompute with the trainer, compare bits.

1. model: --model PATH, or the built-in tiny Qwen3 (built and cached on first use);
2. prompts: --prompts FILE (one per line, or JSON lines with a "prompt"), or built-in ones;
3. generate under each composition (rollout.py), also with stock vLLM when --against-stock;
4. score every generated token with the training class under several packings (score.py);
5. print the table (or --json) and exit 0 only when every vexact token matches.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from .report import Row, to_json, to_table, verdict
from .rollout import RolloutSettings, run_compositions
from .score import compare, load_trainer, trainer_log_probs

COMPOSITIONS = ("alone", "batch", "shuffled", "chunked-prefill", "preemption")

BUILTIN_PROMPTS = [
    "The capital of France is",
    "1 plus 1 is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "12 plus 7 is 19. 20 plus 5 is",
    "Count with me: one, two, three, four,",
    "The quick brown fox jumps over the lazy dog. The lazy dog",
    "Write a short poem about the moon.",
    "Q: What is the color of the sky on a clear day? A:",
    "In reinforcement learning, the policy that generates the data and the policy that is trained "
    "should be the same; when they differ, the training is said to be off-policy, and the importance "
    "weights that correct for it grow with every step in which the two drift apart, until",
    "Numbers: 3 5 7 11 13 17 19 23 29 31 37 41 43 47 53 59 61 67 71 73 79 83 89 97 and then",
    "Hello",
    "A list of fruits: apple, banana, cherry, date, elderberry, fig, grape, and",
]


def read_prompts(path: str | None, num_prompts: int) -> list[str]:
    if path is None:
        prompts = BUILTIN_PROMPTS
    else:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        prompts = [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line for line in lines]
        if not prompts:
            raise SystemExit(f"error: {path} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def tokenize(model_path: str, prompts: list[str], max_model_len: int, max_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise SystemExit(f"error: prompt {i} is empty after tokenization")
        if len(p) + max_tokens > max_model_len:
            raise SystemExit(
                f"error: prompt {i} has {len(p)} tokens; with --max-tokens {max_tokens} it exceeds the model "
                f"length {max_model_len}. Shorten the prompt or lower --max-tokens."
            )
    return ids


def resolve_model(path: str | None) -> str:
    if path is not None:
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(f"error: {path} is not a Hugging Face checkpoint directory (no config.json)")
        return path
    from vexact_vllm.tiny_model import build_tiny_model

    return str(build_tiny_model("qwen3"))


@contextlib.contextmanager
def diagnostics_to_stderr():
    """vLLM (and its engine processes, which inherit the descriptor) log to stdout; send that to
    stderr so stdout carries only the report (a table, or JSON a machine can parse)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_check(args) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with diagnostics_to_stderr():
        rows, model_path, n_prompts, bisect_note = _run(args)
    meta = {"model": model_path, "prompts": n_prompts, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": args.seed}
    if bisect_note:
        meta["bisect"] = bisect_note
    report = to_json(rows, meta) if args.json else to_table(rows) + (f"\n{bisect_note}" if bisect_note else "")
    print(report, flush=True)
    if args.output:
        Path(args.output).write_text(report + "\n")
    if args.plot:
        from .plot import plot_differences

        plot_differences(rows, args.plot)
    return 0 if verdict(rows) else 1


def _bisect(trainer, results, rows, forced: bool) -> str | None:
    """On the first mismatching vexact request (or request 0 when --bisect asks for it anyway)."""
    from .bisect import bisect_sequence, describe

    for (engine, result), row in zip(results, rows):
        first = row.comparison.first
        if engine != "vexact" or (first is None and not forced):
            continue
        r = result.rollouts[first.request if first is not None else 0]
        where = f"{result.name}, request {first.request if first is not None else 0}"
        return f"{describe(bisect_sequence(trainer, r.prompt_ids + r.output_ids, len(r.prompt_ids)))} [{where}]"
    return None


def _run(args) -> tuple[list[Row], str, int, str | None]:
    from tqdm import tqdm

    model_path = resolve_model(args.model)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    max_model_len = args.max_model_len
    prompts = read_prompts(args.prompts, args.num_prompts)
    prompt_ids = tokenize(model_path, prompts, max_model_len, args.max_tokens)
    names = [c.strip() for c in args.compositions.split(",") if c.strip()]
    unknown = sorted(set(names) - set(COMPOSITIONS))
    if unknown:
        raise SystemExit(f"error: unknown composition(s) {unknown}; choose from {', '.join(COMPOSITIONS)}")
    packings = [int(x) for x in args.micro_batches.split(",")]

    settings = RolloutSettings(
        model=model_path,
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    steps = len(names) + (1 if args.against_stock else 0) + 1
    progress = tqdm(total=steps, desc="vexact-vllm check", file=sys.stderr, disable=args.json or args.quiet)
    results = [("vexact", r) for r in run_compositions(prompt_ids, settings, names, progress)]
    if args.against_stock:
        stock = RolloutSettings(**{**settings.__dict__, "model_impl": "vllm"})
        results += [("stock", r) for r in run_compositions(prompt_ids, stock, ["batch"], progress)]

    trainer = load_trainer(model_path, dtype)
    rows: list[Row] = []
    for engine, result in results:
        scored = [trainer_log_probs(trainer, result.rollouts, mb, args.temperature) for mb in packings]
        comparisons = [compare(result.rollouts, s) for s in scored]
        worst = max(comparisons, key=lambda c: (c.mismatches, c.max_abs_diff))
        packing = ",".join("all" if mb <= 0 else str(mb) for mb in packings)
        rows.append(Row(result.name, engine, packing, worst, result.notes))
    progress.update(1)
    progress.close()
    return rows, model_path, len(prompt_ids), _bisect(trainer, results, rows, args.bisect)


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="Hugging Face checkpoint directory (default: built-in tiny Qwen3)")
    parser.add_argument("--prompts", help="file with one prompt per line, or JSON lines with a 'prompt' field")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--compositions", default=",".join(COMPOSITIONS),
                        help=f"comma-separated subset of {', '.join(COMPOSITIONS)}")
    parser.add_argument("--micro-batches", default="1,3,0",
                        help="training micro-batch sizes to pack sequences into (0 = all in one)")
    parser.add_argument("--against-stock", action="store_true",
                        help="also run stock vLLM (--model-impl vllm) against the same training forward")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--output", help="also write the report (table or JSON) to this file")
    parser.add_argument("--plot", help="write a PNG of per-position |log-prob difference| (needs matplotlib)")
    parser.add_argument("--bisect", action="store_true",
                        help="replay a request's inference steps in-process and name the first module whose "
                        "output differs from training (runs by itself on a mismatch)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
