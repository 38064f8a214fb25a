"""The named workloads of `vexact-vllm bench` (`--workload`): the request shapes RL rollouts have.

    default       256 prompts of 64-511 tokens, 256 output tokens (the stock vLLM baseline of the
                  project's design notes)
    long          128 prompts of 1,024-4,096 tokens, 4,096-8,192 output tokens: long reasoning rollouts,
                  enough requests to fill the KV cache of a 1.7B-8B model on one GPU
    grpo          64 prompts of 256-1,024 tokens x 8 samples each (one seed per sample), 1,024-2,048
                  output tokens: one GRPO step's rollout, where prefix caching serves each prompt's
                  samples after the first
    decode-small  16 prompts of 64-511 tokens, 1,024 output tokens: 16 concurrent requests, the
                  memory-bound decode regime

Lengths are drawn per request, uniformly in the range, from `--seed`; every pass of a run replays the
same requests. `--num-prompts`, `--input-len`, `--output-len`, `--samples` and `--max-model-len`
override the workload's values (every listed workload's, when `--workload` names several).
"""

from __future__ import annotations

import random
from typing import NamedTuple

WORKLOADS = {
    "default": dict(num_prompts=256, input_len="64-511", output_len="256-256", samples=1, max_model_len=1024),
    "long": dict(num_prompts=128, input_len="1024-4096", output_len="4096-8192", samples=1, max_model_len=12288),
    "grpo": dict(num_prompts=64, input_len="256-1024", output_len="1024-2048", samples=8, max_model_len=3072),
    "decode-small": dict(num_prompts=16, input_len="64-511", output_len="1024-1024", samples=1, max_model_len=1536),
}  # fmt: skip
FIELDS = ("num_prompts", "input_len", "output_len", "samples", "max_model_len")


def split_name(name: str) -> tuple[str, int | None]:
    """"grpo:32" -> ("grpo", 32): a workload and its own prompt count (None: the workload's or
    --num-prompts)."""
    base, _, prompts = name.partition(":")
    return base, int(prompts) if prompts else None


def workload_list(text: str) -> str:
    """argparse type of --workload: one name or several, comma-separated, each a WORKLOADS key,
    optionally with its own prompt count (NAME:PROMPTS, e.g. grpo:32)."""
    names = [n.strip() for n in text.split(",") if n.strip()]

    def ok(name: str) -> bool:
        base, _, prompts = name.partition(":")
        return base in WORKLOADS and (not prompts or (prompts.isdigit() and int(prompts) > 0))

    bases = [n.partition(":")[0] for n in names]
    if not names or not all(ok(n) for n in names) or len(set(bases)) < len(bases):
        import argparse

        raise argparse.ArgumentTypeError(
            f"{text!r}: name workloads from {', '.join(sorted(WORKLOADS))}, comma-separated, each once, "
            "optionally NAME:PROMPTS (e.g. grpo:32)"
        )
    return ",".join(names)


class Request(NamedTuple):
    prompt: list[int]  # token ids
    max_tokens: int
    seed: int


def apply_workload(args) -> None:
    """Fill every workload field the command line left unset (None) from `args.workload` (one name;
    NAME:PROMPTS sets its prompt count, over --num-prompts)."""
    base, prompts = split_name(args.workload)
    if prompts is not None:
        args.num_prompts = prompts
    for field in FIELDS:
        if getattr(args, field) is None:
            setattr(args, field, WORKLOADS[base][field])


def for_workload(args, name: str):
    """A copy of `args` for workload `name`: its fields, the command line's overrides kept."""
    import copy

    one = copy.copy(args)
    one.workload = name
    apply_workload(one)
    return one


def shared_max_model_len(names: list[str]) -> int:
    """The engine's max_model_len when one engine runs several workloads: the largest of theirs."""
    return max(WORKLOADS[split_name(n)[0]]["max_model_len"] for n in names)


def bounds(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    return lo, hi


def requests(args) -> list[Request]:
    """The workload's requests: `samples` consecutive requests per prompt (the same prompt ids,
    seeds seed, seed + 1, ...), lengths drawn from `args.seed`."""
    rng = random.Random(args.seed)
    (in_lo, in_hi), (out_lo, out_hi) = bounds(args.input_len), bounds(args.output_len)
    out = []
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(10, args.vocab_limit) for _ in range(rng.randint(in_lo, in_hi))]
        for _ in range(args.samples):
            out.append(Request(prompt, rng.randint(out_lo, out_hi), args.seed + len(out)))
    return out


def describe(args) -> str:
    """One line: the workload as run (after overrides)."""
    samples = f" x {args.samples} samples" if args.samples > 1 else ""
    return (f"workload {args.workload}: {args.num_prompts} prompts of {args.input_len} tokens{samples}, "
            f"{args.output_len} output tokens")  # fmt: skip
