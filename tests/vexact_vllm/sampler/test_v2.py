"""The runner-v2 sampler's per-row inputs and refusals (its full step runs on the GPU host:
`vexact-vllm check` and tests/e2e there)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm


def _sampler(temperatures, seeds):
    from vexact_vllm.sampler.v2 import VexactSamplerV2

    base = SimpleNamespace(
        sampling_states=SimpleNamespace(
            temperature=SimpleNamespace(gpu=torch.tensor(temperatures, dtype=torch.float32)),
            seeds=SimpleNamespace(gpu=torch.tensor(seeds, dtype=torch.int64)),
        )
    )
    return VexactSamplerV2.from_base(base)


def _batch():
    return SimpleNamespace(
        expanded_idx_mapping=torch.tensor([2, 0, 1, 3]),
        positions=torch.tensor([5, 6, 7, 40, 41, 9, 3]),
        logits_indices=torch.tensor([2, 4, 5, 6]),
    )


def test_rows_follow_the_request_slots():
    temperatures = [0.0, 0.7, 1.0, 1e-6]
    sampler = _sampler(temperatures, [11, 22, 33, 44])
    batch = _batch()
    host = np.array(temperatures, np.float32)[[2, 0, 1, 3]]
    tau, seeds, positions = sampler.rows(batch, host)
    # 1e-6 is greedy for vLLM (< GREEDY_EPS): zeroed, so that the kernels score it at 1, not 0.01
    assert torch.equal(tau, torch.tensor([1.0, 0.0, 0.7, 0.0]))
    assert torch.equal(seeds, torch.tensor([33, 11, 22, 44]))
    # the key is the position of the token being sampled: one past the last input token (as V1's)
    assert torch.equal(positions, torch.tensor([8, 42, 10, 4]))


def test_rows_launch_nothing_for_the_temperature_on_a_usual_batch():
    """No temperature in (0, GREEDY_EPS) (vLLM raises those to 0.01): the requested temperatures go
    to the log-prob kernels as they are, which score 0 at 1 themselves."""
    from vexact_vllm.kernels import log_softmax

    temperatures = [0.0, 0.7, 1.0, 0.01]
    sampler = _sampler(temperatures, [11, 22, 33, 44])
    tau, _, _ = sampler.rows(_batch(), np.array(temperatures, np.float32)[[2, 0, 1, 3]])
    assert torch.equal(tau, torch.tensor([1.0, 0.0, 0.7, 0.01]))
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    ones = log_softmax(logits, 1.0)
    assert torch.equal(log_softmax(logits, tau)[1], ones[1])  # the greedy row: scored at 1


# Per request slot: its logprob_token_ids (vLLM's LogprobTokenIdsState, padded to 4 columns).
CUSTOM_IDS = [[9, 8, 7, 0], [0, 0, 0, 0], [4, 0, 0, 0], [650, 3, 2, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
CUSTOM_COUNTS = [3, 0, 1, 4, 0, 0]


def _step_sampler(monkeypatch, num_logprobs, token_ids=0, top_p=1.0):
    """A VexactSamplerV2 over fake runner-v2 states (6 request slots, a batch of 4 rows), with
    vLLM's Triton helper `get_num_sampled_and_rejected` (not what is tested) replaced."""
    from vexact_vllm.sampler import v2

    def state(values, dtype):
        t = torch.tensor(values, dtype=dtype)
        return SimpleNamespace(gpu=t, np=t.numpy())

    monkeypatch.setattr(v2, "get_num_sampled_and_rejected", lambda *args: (None, None))
    slots = 6
    base = SimpleNamespace(
        sampling_states=SimpleNamespace(
            temperature=state([0.0, 0.7, 1.0, 0.9, 1.3, 0.0], torch.float32),
            seeds=state([5, 6, 7, 8, 9, 10], torch.int64),
            top_k=state([0] * slots, torch.int32),
            top_p=state([top_p] * slots, torch.float32),
            min_p=state([0.0] * slots, torch.float32),
            max_num_logprobs=lambda idx: num_logprobs,
        ),
        logprob_token_ids_state=SimpleNamespace(
            max_num_token_ids=lambda idx: token_ids,
            token_ids=state(CUSTOM_IDS, torch.int32),
            num_token_ids=state(CUSTOM_COUNTS if token_ids else [0] * slots, torch.int32),
        ),
        req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=None)),
        compute_nans=False,
    )
    sampler = v2.VexactSamplerV2.from_base(base)
    sampler._kernels_warm = True  # no warm-up: it would capture nothing on CPU anyway
    batch = SimpleNamespace(
        expanded_idx_mapping=torch.tensor([3, 0, 1, 4], dtype=torch.int32),
        idx_mapping_np=np.array([3, 0, 1, 4]),
        positions=torch.tensor([4, 9, 13, 2, 30, 7]),
        logits_indices=torch.tensor([1, 2, 4, 5]),
        cu_num_logits_np=np.arange(5),
        seq_lens=torch.ones(4, dtype=torch.int32),
        num_reqs=4,
        cu_num_logits=None,
        idx_mapping=None,
    )
    return sampler, batch


@pytest.mark.parametrize(
    "num_logprobs, token_ids, top_p, output",
    [
        (-1, 0, 1.0, "tokens"),  # NO_LOGPROBS: nothing asked
        (0, 0, 1.0, "token_log_probs"),  # the sampled token's log-prob: RL's case
        (2, 0, 1.0, "log_probs"),  # top-k log-probs
        (-1, 4, 1.0, "log_probs"),  # logprob_token_ids (rows of slots 3, 0, 1, 4: 4, 3, 0 and 0 ids)
        (2, 4, 1.0, "log_probs"),  # logprob_token_ids beside top-k: a row without ids gets the top-k
        (0, 0, 0.9, "log_probs"),  # top-p: the truncated path writes the log-probs
    ],
)
def test_a_step_returns_the_log_probs_the_batch_asks_for(monkeypatch, num_logprobs, token_ids, top_p, output):
    """The step's tokens are the composition's (log_softmax, draw_tokens), whichever path runs; its
    LogprobsTensors are laid out as vLLM's compute_topk_scores lays them out (the token, then the
    row's logprob_token_ids or its top-k, ties to the lower id; 0 and -inf in empty columns), with
    vLLM's rank, without [B, V] log-probs in the token-only case."""
    from vexact_vllm.kernels import log_softmax, top_k_ids, truncation_threshold
    from vexact_vllm.sampler.rules import draw_tokens

    sampler, batch = _step_sampler(monkeypatch, num_logprobs, token_ids, top_p)
    host_t = sampler.sampling_states.temperature.np[batch.idx_mapping_np]
    assert sampler.output_for(batch.idx_mapping_np) == ("token_log_probs" if output == "log_probs" and top_p < 1
                                                        else output)  # fmt: skip
    logits = torch.randn(4, 700, generator=torch.Generator().manual_seed(1)) * 3
    result = sampler(logits.clone(), batch)
    tau, seeds, positions = sampler.rows(batch, host_t)
    log_probs = log_softmax(logits, tau)
    greedy = torch.from_numpy(host_t < 1e-5)
    thr = None
    if top_p < 1:
        thr = truncation_threshold(log_probs, None, torch.full((4,), top_p), None)
    tokens = draw_tokens(log_probs, greedy, host_t < 1e-5, seeds, positions, thr)
    assert torch.equal(result.sampled_token_ids, tokens.view(-1, 1))
    lt = result.logprobs_tensors
    if output == "tokens":
        assert lt is None
        return
    token_lp = log_probs.gather(1, tokens[:, None])
    k = max(num_logprobs, 0)
    rest = top_k_ids(log_probs, k)  # [4, k]
    if token_ids:  # rows of slots 3, 0, 1, 4: their own ids where they have some, else the top-k
        cols = max(k, token_ids)
        rest = torch.nn.functional.pad(rest, (0, cols - k))
        counts = torch.tensor(CUSTOM_COUNTS)[[3, 0, 1, 4]]
        custom = torch.tensor(CUSTOM_IDS)[[3, 0, 1, 4], :cols]
        valid = torch.where(counts[:, None] > 0, torch.arange(cols) < counts[:, None], torch.arange(cols) < k)
        rest = torch.where(counts[:, None] > 0, custom, rest) * valid
    ids = torch.cat((tokens[:, None], rest), dim=1)
    expected_lp = log_probs.gather(1, ids)
    if token_ids:
        expected_lp[:, 1:] = expected_lp[:, 1:].masked_fill(~valid, float("-inf"))
    assert torch.equal(lt.logprob_token_ids, ids)
    assert torch.equal(lt.logprobs, expected_lp)
    assert torch.equal(lt.logprobs[:, :1], token_lp)
    assert torch.equal(lt.selected_token_ranks, (log_probs >= token_lp).sum(-1))
    assert lt.cu_num_generated_tokens is None


def test_the_model_gives_runner_v2_the_vexact_state():
    """Runner v2 takes the model's state class (`get_model_state_cls`), whose `custom_sampler`
    returns the vexact sampler over vLLM's states."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vexact_vllm.sampler.v2 import VexactModelState, VexactSamplerV2
    from vexact_vllm.vllm_wrapper import VllmVexactForCausalLM

    state_cls = VllmVexactForCausalLM.get_model_state_cls()
    assert state_cls is VexactModelState and issubclass(state_cls, DefaultModelState)
    state = state_cls.__new__(state_cls)
    state.vllm_config = SimpleNamespace(speculative_config=None, compilation_config=SimpleNamespace(cudagraph_mode=None))
    state.model = object()
    base = SimpleNamespace(sampling_states=None)
    sampler, extra = state.custom_sampler(base)
    assert isinstance(sampler, VexactSamplerV2) and extra is None
    assert sampler.model is state.model and sampler.use_graphs
