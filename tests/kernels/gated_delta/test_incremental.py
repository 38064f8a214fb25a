"""Design C of the gated delta rule on the torch path (CPU): random schedules of decode steps and prefill
chunks from random boundary states give the packed training forward's outputs and states bit for bit,
every row count of a partial chunk included, in fp32 and bf16 at small odd shapes (chunks of 8 rows);
the forward against the float64 recurrence, the gradients against its float64 autograd, the cache's
size, refusals."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper modules (importlib import mode)

from gated_delta_reference import gdn_inputs  # noqa: E402
from incremental_checks import (  # noqa: E402
    check_every_row_count,
    check_gradients,
    check_padded_requests,
    check_schedules,
    random_case,
    reference,
)

from vexact_vllm.kernels.gated_delta import incremental_cache as layout  # noqa: E402
from vexact_vllm.kernels.gated_delta.incremental import (  # noqa: E402
    incremental_gated_delta_rule,
    incremental_gated_delta_rule_cached,
)

F32, BF16 = torch.float32, torch.bfloat16
# dtype -> tolerance of o against the float64 recurrence (bf16: the products' operands are rounded to bf16)
TOL = {F32: 2e-6, BF16: 2e-2}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(layout, "CHUNK", 8)


@pytest.mark.parametrize("dtype,seed", [(F32, 0), (BF16, 1), (F32, 2)], ids=["f32-0", "bf16-1", "f32-2"])
def test_schedules_match_training_bitwise(dtype, seed):
    inputs, h0 = random_case(seed, dtype)
    o, states = check_schedules(incremental_gated_delta_rule, incremental_gated_delta_rule_cached, inputs, h0)
    want_o, want_states = reference(inputs, h0)
    torch.testing.assert_close(o.double(), want_o, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(states.double(), want_states, atol=10 * TOL[dtype], rtol=10 * TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_every_row_count_of_a_partial_chunk(dtype):
    check_every_row_count(incremental_gated_delta_rule, incremental_gated_delta_rule_cached, 2, 4, 16, 16, dtype)


def test_padded_requests_touch_nothing():
    check_padded_requests(incremental_gated_delta_rule_cached)


def test_gradients_match_float64_autograd():
    inputs, h0 = random_case(3, F32)
    check_gradients(incremental_gated_delta_rule, inputs, h0, rtol=2e-5)


def test_full_chunks_of_64_match_training():
    """The production chunk: sequences over a chunk boundary, decoded row by row after a prefill."""
    layout.CHUNK = 64
    inputs = gdn_inputs([70, 64, 3], 1, 2, 16, 16, seed=5)
    o, states = check_schedules(incremental_gated_delta_rule, incremental_gated_delta_rule_cached, inputs, None,
                                seeds=(1,), max_chunk=80)  # fmt: skip
    torch.testing.assert_close(o.double(), reference(inputs)[0], atol=2e-6, rtol=2e-6)


def test_cache_bytes_at_qwen35_shape():
    layout.CHUNK = 64
    assert layout.IncrementalCache.bytes_per_slot(16, 48, 128, 128) == 7_323_264
    cache = layout.IncrementalCache.empty(1, 16, 48, 128, 128, BF16, "cpu")
    assert sum(t.numel() * t.element_size() for t in cache.tensors()) == 7_323_264


def test_refusals():
    inputs = gdn_inputs([3, 2], 1, 2, 16, 16)
    cache = layout.IncrementalCache.empty(2, 1, 2, 16, 16, F32, "cpu")
    slots, has, context = torch.tensor([0, 1]), torch.tensor([False, False]), torch.tensor([0, 0])
    rows = {n: inputs[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "cu_seqlens")}
    with pytest.raises(ValueError, match="distinct"):
        incremental_gated_delta_rule_cached(**rows, cache=cache, slots=torch.tensor([1, 1]), has_state=has,
                                            context_lens=context)  # fmt: skip
    small = layout.IncrementalCache.empty(2, 1, 2, 16, 8, F32, "cpu")
    with pytest.raises(ValueError, match="cache.state"):
        incremental_gated_delta_rule_cached(**rows, cache=small, slots=slots, has_state=has, context_lens=context)
    with pytest.raises(ValueError, match="context_lens"):
        incremental_gated_delta_rule_cached(**rows, cache=cache, slots=slots, has_state=has, context_lens=-context - 1)
    strided = layout.IncrementalCache(*(t.transpose(-1, -2) if t.dim() == 4 else t for t in cache.tensors()))
    with pytest.raises(ValueError, match="each slot contiguously"):
        incremental_gated_delta_rule_cached(**rows, cache=strided, slots=slots, has_state=has, context_lens=context)
    with pytest.raises(ValueError, match="inference only"):
        incremental_gated_delta_rule_cached(**{**rows, "q": inputs["q"].requires_grad_()}, cache=cache, slots=slots,
                                            has_state=has, context_lens=context)  # fmt: skip
    with pytest.raises(ValueError, match="initial_state"):
        incremental_gated_delta_rule(**rows, initial_state=torch.zeros(1, 2, 16, 16))
