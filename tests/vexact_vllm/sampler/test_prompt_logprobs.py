"""Prompt log-probs (sampler/prompt_logprobs.py for runner v2, the V1 sampler's hooks) equal the
trainer's: each prompt token's log-prob is what `linear_token_log_probs` (the trainer's function)
gives its row at temperature 1, and the top-k and rank are `kernels.score_tokens`' over the trainer's
log-probs. Runner v2's own `PromptLogprobsWorker` runs here on fakes of its inputs (its one Triton
helper restated in torch), chunked prefill and accumulation included; the full engine runs in
tests/e2e and `vexact-vllm check --prompt-logprobs`."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vexact_vllm.kernels import linear, linear_token_log_probs, log_softmax, score_tokens

pytestmark = pytest.mark.vllm

VOCAB, HIDDEN = 300, 64


class FakeModel:
    """A vexact model's `compute_logits`: the lm_head GEMM in fp32, as vllm_wrapper's."""

    is_vexact_model = True

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.weight = (torch.randn(VOCAB, HIDDEN, generator=g) / 4).bfloat16()
        self.calls: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        return linear(hidden, self.weight, out_dtype=torch.float32)


class StockModel(FakeModel):
    is_vexact_model = False


def _trainer(model: FakeModel, hidden: torch.Tensor, tokens: torch.Tensor, k: int):
    """What the trainer computes for rows `hidden` scoring `tokens`: the fused log-prob function's
    values, and the top-k and ranks over its log-probs."""
    values = linear_token_log_probs(hidden, model.weight, tokens, 1.0)
    scores = score_tokens(log_softmax(linear(hidden, model.weight, out_dtype=torch.float32), 1.0), tokens, k)
    assert torch.equal(scores.log_probs[:, 0], values)  # one function: fused == unfused
    return scores


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_scores_are_the_trainers_in_any_chunking(monkeypatch, k):
    from vexact_vllm.sampler import prompt_logprobs

    model = FakeModel()
    hidden = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    tokens = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    want = _trainer(model, hidden, tokens.long(), k)
    whole = prompt_logprobs.prompt_scores(tokens, hidden, model.compute_logits, k)
    assert model.calls == [30]
    monkeypatch.setattr(prompt_logprobs, "CHUNK_ROWS", 7)  # never [N, V] at once: 7, 7, 7, 7, 2 rows
    chunked = prompt_logprobs.prompt_scores(tokens, hidden, model.compute_logits, k)
    assert model.calls == [30, 7, 7, 7, 7, 2]
    for got in (whole, chunked):
        ids, values, ranks = got
        assert ids.dtype == torch.int64 and tuple(ids.shape) == (30, 1 + k)
        assert (
            torch.equal(ids, want.ids)
            and torch.equal(values, want.log_probs)
            and torch.equal(ranks, want.ranks)
        )


def test_the_whole_vocabulary_and_out_of_range_rows():
    """num_prompt_logprobs -1 scores every id; a row vLLM drops may name any id (clamped, no error)."""
    from vexact_vllm.sampler.prompt_logprobs import prompt_scores

    model = FakeModel()
    hidden = torch.randn(3, HIDDEN).bfloat16()
    ids, values, _ = prompt_scores(torch.tensor([4, 5, 10**6]), hidden, model.compute_logits, -1)
    assert tuple(ids.shape) == (3, 1 + VOCAB) and ids[2, 0] == VOCAB - 1
    assert torch.equal(values[:2, 1:].sort(-1, descending=True).values, values[:2, 1:])
    with pytest.raises(ValueError, match="raw_logits"):
        prompt_scores(torch.tensor([4]), hidden[:1], model.compute_logits, 0, "raw_logits")


def test_the_wrapper_acts_for_vexact_models_only():
    from vexact_vllm.sampler.prompt_logprobs import wrap_prompt_logprobs

    calls = []

    def original(*args):
        calls.append(args)
        return "vllm"

    wrapped = wrap_prompt_logprobs(original)
    hidden, tokens = torch.randn(4, HIDDEN).bfloat16(), torch.tensor([1, 2, 3, 4])
    assert wrapped(tokens, hidden, StockModel().compute_logits, 2) == "vllm" and len(calls) == 1
    assert wrapped(tokens, hidden, lambda h: None, 2) == "vllm" and len(calls) == 2
    ids, _, _ = wrapped(tokens, hidden, FakeModel().compute_logits, 2)
    assert tuple(ids.shape) == (4, 3) and len(calls) == 2


@pytest.fixture
def vllm_patched():
    """vLLM's patch table installed, as the plugin installs it in every vLLM process: the worker
    tests reach the wrapper through its row, as runner v2 does."""
    from vexact_vllm import vllm_patches

    with vllm_patches.installed():
        yield


def test_the_patch_table_routes_runner_v2s_prompt_log_probs(vllm_patched):
    """Runner v2's `PromptLogprobsWorker.compute_prompt_logprobs` calls the module-level
    `compute_prompt_logprobs_with_chunking`: with the table installed that name is the wrapper, so
    a vexact model's prompt rows come from `prompt_scores`, never vLLM's own log-softmax."""
    from vllm.v1.worker.gpu.sample import prompt_logprob

    from vexact_vllm.sampler.prompt_logprobs import prompt_scores

    patched = prompt_logprob.compute_prompt_logprobs_with_chunking
    assert getattr(patched, "_vexact", False) and patched.__wrapped__.__module__ == prompt_logprob.__name__
    hidden, tokens = torch.randn(5, HIDDEN).bfloat16(), torch.tensor([1, 2, 3, 4, 0])
    model = FakeModel()
    got, want = patched(tokens, hidden, model.compute_logits, 2), prompt_scores(tokens, hidden, model.compute_logits, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _token_ids_torch(num_tokens, query_start_loc, idx_mapping, num_computed_tokens, all_token_ids):
    """vLLM's `get_prompt_logprobs_token_ids` (a Triton kernel) in torch: row i of request b scores
    the token after it, all_token_ids[slot, computed + 1 + i]."""
    out = torch.empty(num_tokens, dtype=torch.int64)
    for b, slot in enumerate(idx_mapping.tolist()):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        start = int(num_computed_tokens[slot]) + 1
        out[lo:hi] = all_token_ids[slot, start : start + hi - lo]
    return out


def _batch(steps):
    """A runner-v2 InputBatch of (req_id, slot, computed, scheduled, prefill_len) rows."""
    scheduled = np.array([s[3] for s in steps], np.int32)
    starts = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    slots = [s[1] for s in steps]
    return SimpleNamespace(
        req_ids=[s[0] for s in steps],
        idx_mapping_np=np.array(slots), idx_mapping=torch.tensor(slots, dtype=torch.int32),
        num_computed_prefill_tokens_np=np.array([s[2] for s in steps]),
        prefill_len_np=np.array([s[4] for s in steps]),
        num_scheduled_tokens=scheduled, num_tokens=int(starts[-1]),
        query_start_loc_np=starts, query_start_loc=torch.from_numpy(starts),
    )  # fmt: skip


@pytest.mark.parametrize("k", [0, 3])
def test_vllms_worker_returns_the_trainers_values_over_chunked_prefill(monkeypatch, vllm_patched, k):
    """vLLM's `PromptLogprobsWorker` with the wrapper in place: request a (25 prompt tokens) in
    three prefill chunks beside request b (8 tokens, whole, then decoding) and c (no prompt
    log-probs): a's 24 and b's 7 rows come back once each prompt is done, every row the trainer's."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample import prompt_logprob

    from vexact_vllm.sampler import prompt_logprobs

    monkeypatch.setattr(prompt_logprob, "get_prompt_logprobs_token_ids", _token_ids_torch)
    monkeypatch.setattr(prompt_logprobs, "CHUNK_ROWS", 6)  # chunks across requests' rows
    g = torch.Generator().manual_seed(3)
    prompts = {"a": torch.randint(0, VOCAB, (25,), generator=g), "b": torch.randint(0, VOCAB, (8,), generator=g),
               "c": torch.randint(0, VOCAB, (5,), generator=g)}  # fmt: skip
    slots = {"a": 2, "b": 0, "c": 1}
    hidden = {r: torch.randn(40, HIDDEN, generator=g).bfloat16() for r in prompts}  # per position
    all_token_ids = torch.zeros(3, 64, dtype=torch.int64)
    for r, p in prompts.items():
        all_token_ids[slots[r], : len(p)] = p
    all_token_ids[0, 8] = 17  # b's first sampled token
    prompt_lens = np.zeros(3, np.int64)
    for r, p in prompts.items():
        prompt_lens[slots[r]] = len(p)

    worker = prompt_logprob.PromptLogprobsWorker(3, torch.device("cpu"))
    for r in prompts:
        worker.add_request(r, slots[r], SamplingParams(prompt_logprobs=None if r == "c" else k))
    model = FakeModel()
    # steps: (req, slot, computed, scheduled, prefill_len)
    schedule = [
        [("a", 2, 0, 10, 25), ("b", 0, 0, 8, 8), ("c", 1, 0, 5, 5)],
        [("a", 2, 10, 9, 25), ("b", 0, 8, 1, 8), ("c", 1, 5, 1, 5)],
        [("a", 2, 19, 6, 25), ("b", 0, 9, 1, 8)],
    ]
    returned = {}
    for steps in schedule:
        batch = _batch(steps)
        rows = torch.cat([hidden[r][c : c + n] for r, _, c, n, _ in steps])
        computed = torch.zeros(3, dtype=torch.int64)
        for _, slot, c, _, _ in steps:
            computed[slot] = c
        out = worker.compute_prompt_logprobs(
            model.compute_logits, rows, batch, all_token_ids, computed, prompt_lens
        )
        assert not set(out) & set(returned)
        returned.update(out)
    assert sorted(returned) == ["a", "b"]
    for r in ("a", "b"):
        n = len(prompts[r])
        want = _trainer(model, hidden[r][: n - 1], prompts[r][1:], k)
        got = returned[r]
        assert torch.equal(got.logprob_token_ids, want.ids)
        assert torch.equal(got.logprobs, want.log_probs)
        assert torch.equal(got.selected_token_ranks, want.ranks)


def test_the_v1_sampler_scores_prompts_with_the_same_functions():
    """vLLM's V1 runner scores a prompt chunk with `sampler.compute_logprobs` then
    `sampler.gather_logprobs`: with the vexact sampler, the trainer's values, top-k and ranks (ids
    as int32, vLLM V1's layout); and its top-k breaks exact ties by the lower id."""
    from vexact_vllm.sampler.v1 import VexactSampler

    model = FakeModel()
    hidden = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16()
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5))
    want = _trainer(model, hidden, tokens, 4)
    ids, values, ranks, *_ = VexactSampler.gather_logprobs(
        VexactSampler.compute_logprobs(model.compute_logits(hidden)), 4, tokens
    )
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want.ids)
    assert torch.equal(values, want.log_probs) and torch.equal(ranks, want.ranks)
    tied = torch.tensor([[-2.0, -1.0, -3.0, -1.0, -1.0]])
    ids, values, ranks, *_ = VexactSampler.gather_logprobs(tied, 2, torch.tensor([4]))
    assert ids.tolist() == [[4, 1, 3]] and ranks.tolist() == [3]


@pytest.mark.parametrize("seed", range(4))
def test_vllms_worker_over_random_chunks_and_preemption(monkeypatch, vllm_patched, seed):
    """A random schedule through vLLM's `PromptLogprobsWorker` with the wrapper in place: random
    prompt lengths, prefill chunk sizes, CHUNK_ROWS and per-request k (the batch's largest k is
    computed, each request keeps its own width). Request "a" is preempted after its first prefill
    chunk: vLLM drops its partial rows (remove_request), re-adds it in another slot and recomputes
    its prompt from 0. Request "b" is preempted after its prompt was returned and one token decoded:
    resumed, it is not scored again. Each scored request comes back once, every row the trainer's."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample import prompt_logprob

    from vexact_vllm.sampler import prompt_logprobs

    rng = np.random.default_rng(seed)
    monkeypatch.setattr(prompt_logprob, "get_prompt_logprobs_token_ids", _token_ids_torch)
    monkeypatch.setattr(prompt_logprobs, "CHUNK_ROWS", int(rng.choice([1, 3, 7, 1024])))
    g = torch.Generator().manual_seed(seed)
    names = ["a", "b", "c", "d"]
    prompts = {r: torch.randint(0, VOCAB, (int(rng.integers(10, 40)),), generator=g) for r in names}
    ks = {
        "a": int(rng.choice([0, 2, 5])),
        "b": int(rng.choice([0, 2, 5])),
        "c": None,
        "d": int(rng.choice([0, 5])),
    }
    hidden = {r: torch.randn(64, HIDDEN, generator=g).bfloat16() for r in names}  # per position
    max_reqs, decode_steps = 6, 3
    sequences = {r: torch.cat([p, torch.randint(0, VOCAB, (16,), generator=g)]) for r, p in prompts.items()}
    all_token_ids = torch.zeros(max_reqs, 80, dtype=torch.int64)
    state = {}  # req -> [slot, computed, prefill_len]

    worker = prompt_logprob.PromptLogprobsWorker(max_reqs, torch.device("cpu"))

    def admit(r, slot, prefill_len):
        all_token_ids[slot] = 0
        all_token_ids[slot, : len(sequences[r])] = sequences[r]
        worker.add_request(r, slot, SamplingParams(prompt_logprobs=ks[r]))
        state[r] = [slot, 0, prefill_len]

    for slot, r in enumerate(names):
        admit(r, slot, len(prompts[r]))
    model, returned, preempted = FakeModel(), {}, set()
    while state:
        steps = []
        for r in [r for r in names if r in state]:
            slot, computed, prefill_len = state[r]
            if computed < prefill_len:
                first = r == "a" and "a" not in preempted and computed == 0
                n = (
                    int(rng.integers(1, len(prompts[r])))
                    if first
                    else int(rng.integers(1, prefill_len - computed + 1))
                )
            else:
                n = 1
            steps.append((r, slot, computed, n, prefill_len))
        batch = _batch(steps)
        rows = torch.cat([hidden[r][c : c + n] for r, _, c, n, _ in steps])
        computed_by_slot = torch.zeros(max_reqs, dtype=torch.int64)
        for _, slot, c, _, _ in steps:
            computed_by_slot[slot] = c
        prompt_lens = np.zeros(max_reqs, np.int64)
        for r, (slot, _, _) in state.items():
            prompt_lens[slot] = len(prompts[r])
        out = worker.compute_prompt_logprobs(
            model.compute_logits, rows, batch, all_token_ids, computed_by_slot, prompt_lens
        )
        assert not set(out) & set(returned)
        returned.update(out)
        for r, _, c, n, _ in steps:
            state[r][1] = c + n
        for r in list(state):
            slot, computed, prefill_len = state[r]
            if r == "a" and "a" not in preempted:  # mid-prompt: partial rows dropped, recomputed
                assert computed < len(prompts[r])
                preempted.add(r)
                worker.remove_request(r)
                admit(r, 4, len(prompts[r]))
            elif r == "b" and "b" not in preempted and computed == len(prompts[r]) + 1:
                assert "b" in returned or ks["b"] is None
                preempted.add(r)
                worker.remove_request(r)
                admit(r, 5, computed)  # resumed: its prefill now runs past the prompt
            elif computed >= max(prefill_len, len(prompts[r])) + decode_steps:
                worker.remove_request(r)
                del state[r]
    assert preempted == {"a", "b"}
    assert sorted(returned) == ["a", "b", "d"]
    for r in ("a", "b", "d"):
        n = len(prompts[r])
        want = _trainer(model, hidden[r][: n - 1], prompts[r][1:], ks[r])
        got = returned[r]
        assert torch.equal(got.logprob_token_ids, want.ids)
        assert torch.equal(got.logprobs, want.log_probs)
        assert torch.equal(got.selected_token_ranks, want.ranks)
