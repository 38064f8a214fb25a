"""`check --prompt-logprobs`: vLLM's prompt entries are read and rebuilt from the trainer exactly as
vLLM lays them out, and a difference in any id, rank or bit is counted and located."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vexact_vllm.cli.prompt_scores import compare_prompts, expected_entries, trainer_prompt_entries
from vexact_vllm.cli.records import Rollout, entries_of
from vexact_vllm.cli.report import verdict


@pytest.mark.vllm
@pytest.mark.parametrize(
    "token, rank, top",
    [(7, 4, [3, 1, 5]), (1, 2, [3, 1, 5]), (3, 1, [3, 1, 5]), (9, 1, []), (1, 3, [3, 1])],
)
def test_expected_entries_are_vllms_container(token, rank, top):
    """vLLM's own `append_logprobs_for_next_position` (the token, then the top-k with ranks 1..k, an
    id in both keeping its first place) read back by `entries_of` == `expected_entries`."""
    from vllm.logprobs import append_logprobs_for_next_position

    lps = {7: -3.5, 3: -0.25, 1: -1.0, 5: -2.0, 9: -0.125}
    built: list = [None]  # position 0 has no log-prob
    append_logprobs_for_next_position(
        built, [token, *top], [lps[token], *(lps[i] for i in top)], [None] * (1 + len(top)), rank, len(top)
    )
    assert entries_of(built) == [expected_entries(token, lps[token], rank, top, [lps[i] for i in top])]


def _entries(token, lp, rank, *top):
    return expected_entries(token, lp, rank, [i for i, _ in top], [v for _, v in top])


def test_compare_prompts_counts_every_difference():
    good = [[_entries(5, -1.5, 2, (4, -1.0), (5, -1.5))], [_entries(8, -3.0, 9, (4, -0.5), (2, -0.75))]]
    rollouts = [Rollout([1, 5], [6], [-1.0], 1.0, good[0]), Rollout([7, 8], [9], [-1.0], 1.0, good[1]),
                Rollout([3, 3], [3], [-1.0])]  # fmt: skip  (the last asked for none: skipped)
    c = compare_prompts(rollouts, [*good, None])
    assert (c.tokens, c.mismatches, c.max_abs_diff, c.first) == (2, 0, 0.0, None)
    ulp = float(torch.nextafter(torch.tensor(-0.75), torch.tensor(0.0)))
    for bad, what in (
        (_entries(8, -3.0, 9, (4, -0.5), (2, ulp)), "trainer's"),  # a top-k value, one fp32 ulp off
        (_entries(8, -3.0, 8, (4, -0.5), (2, -0.75)), "trainer's"),  # the rank
        (_entries(8, -3.0, 9, (2, -0.75), (4, -0.5)), "trainer's"),  # the top-k order
        (_entries(8, ulp, 9, (4, -0.5), (2, -0.75)), "prompt token at position 1"),  # the token's log-prob
    ):
        c = compare_prompts(rollouts, [good[0], [bad], None])
        assert c.mismatches == 1 and (c.first.request, c.first.position) == (1, 1)
        assert what in c.first.describe()
    with pytest.raises(ValueError, match="prompt positions"):
        compare_prompts(rollouts[:1], [[]])


@pytest.mark.vllm
def test_trainer_entries_in_every_packing(tiny_model):
    """The token's entry is the trainer's `packed_log_probs` row at temperature 1, the top-k and rank
    `score_tokens` over its log-probs, the same in every packing; sequences that did not ask get None."""
    from vexact_vllm.cli.score import load_trainer
    from vexact_vllm.kernels import log_softmax, score_tokens
    from vexact_vllm.model_patches import PackedBatch

    model = load_trainer(tiny_model("qwen3"), torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 448, (n,), generator=g).tolist() for n in (9, 2, 14)]
    rollouts = [Rollout(s[:-2], s[-2:], [0.0, 0.0], 0.7, []) for s in seqs]
    rollouts[1].prompt_logprobs = None
    per_packing = [trainer_prompt_entries(model, rollouts, mb, 3) for mb in (1, 2, 0)]
    assert per_packing[0] == per_packing[1] == per_packing[2]
    entries = per_packing[0]
    assert entries[1] is None and [len(e) for e in (entries[0], entries[2])] == [6, 11]
    with torch.no_grad():
        batch = PackedBatch.from_sequences([seqs[2]])
        alone = model.packed_log_probs(batch, 1.0)
        log_probs = log_softmax(model(torch.tensor([seqs[2]])).logits[0], 1.0)
    targets = torch.tensor(seqs[2][1:12])
    scores = score_tokens(log_probs[:11], targets, 3)
    for p, got in enumerate(entries[2]):
        top = scores.ids[p, 1:].tolist()
        want = expected_entries(seqs[2][p + 1], float(alone[p]), int(scores.ranks[p]), top,
                                scores.log_probs[p, 1:].tolist())  # fmt: skip
        assert got == want and got[0][1] == float(scores.log_probs[p, 0])


@pytest.mark.vllm
def test_prompt_rows_come_after_the_generated_rows_and_decide(tiny_model):
    from vexact_vllm.cli.check import score_rows
    from vexact_vllm.cli.rollout import CompositionResult
    from vexact_vllm.cli.score import load_trainer, trainer_log_probs

    model = load_trainer(tiny_model("qwen3"), torch.bfloat16, torch.device("cpu"))
    rollouts = [Rollout([3, 17, 99, 4], [12, 8], [], 1.0, []), Rollout([5, 6], [7], [], 1.0, [])]
    for r, lp in zip(rollouts, trainer_log_probs(model, rollouts, 0)):
        r.logprobs = lp.tolist()
    for r, e in zip(rollouts, trainer_prompt_entries(model, rollouts, 0, 2)):
        r.prompt_logprobs = e
    results = [("vexact", CompositionResult("batch", rollouts)), ("vexact", CompositionResult("alone", rollouts))]
    rows = score_rows(model, results, [1, 0], prompt_k=2)
    assert [r.composition for r in rows] == ["batch", "alone", "batch: prompt log-probs (top 2)",
                                             "alone: prompt log-probs (top 2)"]  # fmt: skip
    assert rows[2].comparison.tokens == 4 and verdict(rows)
    lp = rollouts[0].prompt_logprobs[1][0]
    rollouts[0].prompt_logprobs[1][0] = (lp[0], math.nextafter(lp[1], 0.0), lp[2])
    rows = score_rows(model, results[:1], [0], prompt_k=2)
    assert rows[0].passed and not rows[1].passed and not verdict(rows)
    assert "prompt token at position 2" in rows[1].comparison.first.describe()
    assert len(score_rows(model, results[:1], [0])) == 1  # without --prompt-logprobs: no prompt row


def test_entries_of_skips_position_zero():
    lp = SimpleNamespace
    out = [None, {4: lp(logprob=-1.25, rank=3), 9: lp(logprob=-0.5, rank=1)}, {2: lp(logprob=-2.0, rank=7)}]
    assert entries_of(out) == [[(4, -1.25, 3), (9, -0.5, 1)], [(2, -2.0, 7)]]
