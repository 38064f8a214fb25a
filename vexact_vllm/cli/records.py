"""What the check's phases hand each other: a rollout (vLLM's side of one request), and the result of
comparing rollouts with the trainer (a comparison and its first mismatch).

The bottom of the check's modules: generating (rollout.py), scoring generated tokens (score.py) and
scoring prompt tokens (prompt_scores.py) all import from here and never from each other.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's entries for one prompt position: (token id, log-prob, rank), in vLLM's order
# (prompt_scores.py says which).
Entries = list[tuple[int, float, int]]


@dataclass
class Rollout:
    """One request's result: prompt and sampled tokens, vLLM's log-prob of each sampled token, and
    the temperature the request asked for (the trainer scores at the same one)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    temperature: float = 1.0
    # Prompt positions 1..P-1: vLLM's entries (`entries_of`), or None when the request did not ask
    # for prompt log-probs.
    prompt_logprobs: list[Entries] | None = None


def entries_of(output_prompt_logprobs) -> list[Entries]:
    """vLLM's `RequestOutput.prompt_logprobs` (None at position 0, then a dict id -> Logprob per
    position) as entries, from position 1."""
    return [[(int(t), float(lp.logprob), int(lp.rank)) for t, lp in d.items()] for d in output_prompt_logprobs[1:]]


@dataclass
class Mismatch:
    request: int
    position: int  # index of the token in its sequence, the prompt counted
    vllm: float
    trainer: float
    output_index: int = 0  # index of the token among the generated ones (position - prompt length)

    def describe(self) -> str:
        return (f"request {self.request}, generated token {self.output_index} (position {self.position} "
                f"counting the prompt): vLLM {self.vllm!r} trainer {self.trainer!r}")  # fmt: skip


@dataclass
class Comparison:
    tokens: int
    mismatches: int
    max_abs_diff: float
    first: Mismatch | None
    per_position: list[tuple[int, float]]  # (position in output, |diff|) for every token, for plots
