"""The training side refuses input it cannot score with a ValueError that names the problem, instead
of a torch-internal error or a silent truncation: no sequences, an empty sequence, ids that are not
integers, ids outside the vocabulary, a batch with no tokens."""

import numpy as np
import pytest
import torch

from tests.model_patches.trainers.test_hf_causal_lm import VOCAB, random_ids
from vexact_vllm.model_patches import PackedBatch


def test_from_sequences_refuses_no_sequences():
    with pytest.raises(ValueError, match="no sequences"):
        PackedBatch.from_sequences([])


@pytest.mark.parametrize("seqs", [[[1, 2], []], [[]], [[3], torch.tensor([], dtype=torch.long)]])
def test_from_sequences_refuses_an_empty_sequence(seqs):
    with pytest.raises(ValueError, match=f"sequence {len(seqs) - 1} is empty"):
        PackedBatch.from_sequences(seqs)


@pytest.mark.parametrize(
    "seqs",
    [
        [[1, 2], [3.7, 4]],  # torch.tensor(..., dtype=long) would truncate this to 3
        [[1.0, 2.0]],
        [[True, False]],
        [torch.tensor([1.0, 2.0])],
        [np.array([0.5, 1.0])],
    ],
)
def test_from_sequences_refuses_non_integer_ids(seqs):
    with pytest.raises(ValueError, match="token ids must be integers"):
        PackedBatch.from_sequences(seqs)


def test_from_sequences_accepts_integer_containers():
    seqs = [(5, 6), np.array([7, 8], dtype=np.int32), torch.tensor([9], dtype=torch.int32)]
    batch = PackedBatch.from_sequences(seqs)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9] and batch.input_ids.dtype == torch.long


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_from_hf_inputs_refuses_non_integer_input_ids(dtype):
    with pytest.raises(ValueError, match="token ids must be integers"):
        PackedBatch.from_hf_inputs(torch.ones(2, 3, dtype=dtype))


def test_from_hf_inputs_refuses_a_flat_input():
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        PackedBatch.from_hf_inputs(torch.tensor([1, 2, 3]))


def test_forward_refuses_float_input_ids(load_model):
    model = load_model("qwen3", torch.float32, True)
    with pytest.raises(ValueError, match="token ids must be integers"):
        model(input_ids=random_ids((1, 5), seed=0).float())


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1, -100])
def test_out_of_vocabulary_ids_are_refused(load_model, bad):
    """Checked once per forward in the model, where the vocabulary size is known: forward (padded or
    not) and packed_log_probs, also under autocast (the masters come back after the error)."""
    model = load_model("qwen3", torch.float32, True)
    ids = random_ids((2, 6), seed=3)
    ids[1, 2] = bad
    message = rf"token id {bad} is outside the vocabulary \[0, {VOCAB}\)"
    with pytest.raises(ValueError, match=message):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=message):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), temperature=1.0)
    with pytest.raises(ValueError, match=message):
        model.packed_log_probs(PackedBatch.from_sequences(ids.tolist()))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=message):
        model.packed_log_probs(PackedBatch.from_sequences(ids.tolist()))
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in model.parameters())


def test_padding_ids_outside_the_vocabulary_are_not_checked(load_model):
    """Rows the attention_mask drops are never embedded, so any id may pad them (-100 included)."""
    model = load_model("qwen3", torch.float32, True)
    ids = random_ids((2, 6), seed=4)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    padded = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    with torch.no_grad():
        assert torch.equal(model(input_ids=padded, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits)


def test_a_batch_without_tokens_is_refused(load_model):
    model = load_model("qwen3", torch.float32, True)
    ids = random_ids((2, 4), seed=5)
    with pytest.raises(ValueError, match="no tokens"):
        model(input_ids=ids, attention_mask=torch.zeros_like(ids))
