"""argparse types for the CLI: bad values are refused while parsing, before any engine starts."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def prompt_top_k(text: str) -> int:
    """How many top log-probs per prompt position: 0 (the prompt token's only) to 20 (vLLM's default
    max_logprobs)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 20:
        raise argparse.ArgumentTypeError(f"must be between 0 and 20 (vLLM's max_logprobs), got {value}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: finite, 0 (greedy) to 2 (vLLM's own bounds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"must be between 0 (greedy) and 2, got {text}")
    return value


def micro_batches(text: str) -> list[int]:
    """Comma-separated training micro-batch sizes, each >= 0 (0 = all sequences in one)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,3,0)") from None
    if not sizes or any(s < 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"give one or more sizes >= 0 (0 = all in one), got {text!r}")
    return sizes


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text
