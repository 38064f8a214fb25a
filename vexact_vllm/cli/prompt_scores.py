"""`vexact-vllm check --prompt-logprobs K`: every prompt token vLLM scores, compared with the trainer.

vLLM returns, for prompt position p >= 1 of a request with `prompt_logprobs=K`, a dict of entries
{token id: (log-prob, rank)} in this order: the prompt token t_p with its log-prob and rank, then the
top-K ids with ranks 1..K (an id in both keeps its first place and takes its top-K rank, as a Python
dict does). vLLM's prompt log-probs are at temperature 1, whatever the request's temperature.

The trainer's entries are built the same way from the training class: the token's log-prob is the
row of `packed_log_probs(batch, temperature=1.0)` that scores it (row p - 1 of its sequence, the
trainer's own entry point), the top-K and the rank are `kernels.score_tokens` over the trainer's
log-probs `log_softmax(linear(hidden, lm_head, fp32), 1.0)` (the one log-prob function; ties in the
top-K to the lower id), taken CHUNK_ROWS rows at a time. A position matches when its entries are
equal: the same ids in the same order, the same ranks, the log-probs equal bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .records import Comparison, Entries, Mismatch, Rollout

CHUNK_ROWS = 1024  # trainer rows per [rows, V] log-softmax: bounds memory only


def expected_entries(token: int, token_lp: float, rank: int, top_ids: list[int], top_lps: list[float]) -> Entries:
    """A position's entries as vLLM builds them (module docstring), from the token's log-prob and
    rank and the top-K ids and log-probs."""
    entries = {token: (token_lp, rank)}
    for j, (i, lp) in enumerate(zip(top_ids, top_lps)):
        entries[i] = (lp, j + 1)
    return [(i, lp, r) for i, (lp, r) in entries.items()]


@torch.no_grad()
def trainer_prompt_entries(
    model, rollouts: list[Rollout], micro_batch: int, k: int, tick: Callable[[], object] | None = None
) -> list[list[Entries] | None]:
    """Per rollout that asked for prompt log-probs, the trainer's entries of its prompt positions
    1..P-1 (None for the others), scored in packed micro-batches of prompt + generated tokens.
    `tick()`: called after every micro-batch (a progress bar)."""
    from vexact_vllm.kernels import linear, log_softmax, score_tokens
    from vexact_vllm.model_patches import PackedBatch

    out: list[list[Entries] | None] = [None] * len(rollouts)
    asked = [i for i, r in enumerate(rollouts) if r.prompt_logprobs is not None]
    size = micro_batch if micro_batch > 0 else max(len(asked), 1)
    weight = model.lm_head.weight
    for lo in range(0, len(asked), size):
        chunk = asked[lo : lo + size]
        batch = PackedBatch.from_sequences([rollouts[i].prompt_ids + rollouts[i].output_ids for i in chunk],
                                           device=weight.device)  # fmt: skip
        token_lp = model.packed_log_probs(batch, 1.0)  # [T]; row t scores token t + 1
        hidden = model.hidden_states(batch)  # [T, H]
        targets, _ = batch.next_tokens()
        for i, start in zip(chunk, batch.cu_seqlens[:-1].tolist()):
            n = len(rollouts[i].prompt_ids) - 1  # rows start .. start + n - 1 score prompt tokens 1..n
            ids, lps, ranks = [], [], []
            for r0 in range(start, start + n, CHUNK_ROWS):
                rows = slice(r0, min(r0 + CHUNK_ROWS, start + n))
                log_probs = log_softmax(linear(hidden[rows], weight, out_dtype=torch.float32), 1.0)
                scores = score_tokens(log_probs, targets[rows], k)
                ids.append(scores.ids[:, 1:].cpu())
                lps.append(scores.log_probs[:, 1:].cpu())
                ranks.append(scores.ranks.cpu())
            prompt = rollouts[i].prompt_ids
            values = token_lp[start : start + n].cpu().tolist()
            ids, lps, ranks = (torch.cat(x).tolist() for x in (ids, lps, ranks)) if n else ([], [], [])
            out[i] = [expected_entries(prompt[p + 1], values[p], ranks[p], ids[p], lps[p]) for p in range(n)]
        if tick is not None:
            tick()
    return out


@dataclass
class PromptMismatch(Mismatch):
    vllm_entries: Entries | None = None
    trainer_entries: Entries | None = None

    def describe(self) -> str:
        if self.vllm != self.trainer or self.vllm_entries is None:
            return (f"request {self.request}, prompt token at position {self.position}: vLLM {self.vllm!r} "
                    f"trainer {self.trainer!r}")  # fmt: skip
        return (f"request {self.request}, prompt position {self.position}: vLLM's entries (id, log-prob, rank) "
                f"{self.vllm_entries} trainer's {self.trainer_entries}")  # fmt: skip


def compare_prompts(rollouts: list[Rollout], trainer: list[list[Entries] | None]) -> Comparison:
    """Positions compared (`tokens`), those whose entries differ (`mismatches`), the largest
    |difference| of the prompt token's log-prob, the first mismatch."""
    tokens = mismatches = 0
    max_diff, first, per_position = 0.0, None, []
    for i, (r, want) in enumerate(zip(rollouts, trainer)):
        if r.prompt_logprobs is None:
            continue
        if want is None or len(r.prompt_logprobs) != len(want):
            raise ValueError(f"request {i}: vLLM scored {len(r.prompt_logprobs)} prompt positions, the trainer "
                             f"{None if want is None else len(want)}")  # fmt: skip
        for p, (got, exp) in enumerate(zip(r.prompt_logprobs, want)):
            v, t = got[0][1], exp[0][1]  # the prompt token's log-prob: its entry comes first
            diff = abs(v - t) if math.isfinite(v) and math.isfinite(t) else 0.0 if v == t else math.inf
            tokens += 1
            max_diff = max(max_diff, diff)
            per_position.append((p, diff))
            if got != exp:  # ids, ranks, and fp32 values (exact as Python floats) all equal, in order
                mismatches += 1
                if first is None:
                    first = PromptMismatch(i, p + 1, v, t, vllm_entries=got, trainer_entries=exp)
    return Comparison(tokens, mismatches, max_diff, first, per_position)
