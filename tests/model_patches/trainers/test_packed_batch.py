"""PackedBatch: packing from sequences and from Hugging Face [B, L] inputs, next-token targets, unpack."""

import pytest
import torch

from vexact_vllm.model_patches import PackedBatch


def test_from_sequences():
    batch = PackedBatch.from_sequences([[7, 8, 9], [4], [5, 6]])
    assert batch.input_ids.tolist() == [7, 8, 9, 4, 5, 6] and batch.input_ids.dtype == torch.long
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.cu_seqlens.dtype == torch.int32


def test_next_tokens_marks_last_token_of_each_sequence():
    batch = PackedBatch.from_sequences([[7, 8, 9], [4], [5, 6]])
    targets, valid = batch.next_tokens()
    assert valid.tolist() == [True, True, False, False, True, False]
    assert targets.tolist() == [8, 9, 0, 0, 6, 0]


@pytest.mark.parametrize("mask_row", [[1, 0, 1], [0, 1, 0, 1], [1, 1, 0, 0, 1, 1]])
def test_from_hf_inputs_rejects_non_contiguous_mask(mask_row):
    ids = torch.arange(2 * len(mask_row)).reshape(2, -1)
    mask = torch.tensor([[1] * len(mask_row), mask_row])
    with pytest.raises(ValueError, match="contiguous"):
        PackedBatch.from_hf_inputs(ids, mask)


def test_from_hf_inputs_right_and_left_padding():
    ids = torch.tensor([[11, 12, 13, 0], [0, 0, 21, 22], [31, 32, 33, 34]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    batch = PackedBatch.from_hf_inputs(ids, mask)
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22, 31, 32, 33, 34]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 9]
    targets, valid = batch.next_tokens()
    assert valid.tolist() == [True, True, False, True, False, True, True, True, False]
    assert targets[valid].tolist() == [12, 13, 22, 32, 33, 34]
    # unpack round-trips, zeros where the input was padding; trailing dims are kept
    values = torch.arange(1, 10, dtype=torch.float32)
    assert torch.equal(batch.unpack(values), torch.tensor([[1, 2, 3, 0], [0, 0, 4, 5], [6, 7, 8, 9.0]]))
    wide = torch.arange(1, 19, dtype=torch.float32).reshape(9, 2)
    out = batch.unpack(wide)
    assert out.shape == (3, 4, 2)
    assert torch.equal(out[mask.bool()], wide)
    assert torch.equal(out[~mask.bool()], torch.zeros(3, 2))
    assert torch.equal(batch.unpack(batch.input_ids), ids)


def test_from_hf_inputs_without_padding():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for mask in (None, torch.ones_like(ids)):
        batch = PackedBatch.from_hf_inputs(ids, mask)
        assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
        assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2]
        assert batch.cu_seqlens.tolist() == [0, 3, 6]
        assert torch.equal(batch.unpack(batch.input_ids), ids)
        assert batch.next_tokens()[1].tolist() == [True, True, False, True, True, False]


def test_from_hf_inputs_packed_position_ids():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    batch = PackedBatch.from_hf_inputs(ids, position_ids=torch.tensor([[0, 1, 2, 0, 0, 1]]))
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.next_tokens()[1].tolist() == [True, True, False, False, True, False]
    assert torch.equal(batch.unpack(batch.input_ids), ids)
    with pytest.raises(ValueError, match="start each sequence at 0"):
        PackedBatch.from_hf_inputs(ids, position_ids=torch.tensor([[1, 2, 3, 0, 1, 2]]))


def test_from_hf_inputs_fully_padded_row():
    """A row with no tokens packs to an empty sequence and unpacks to zeros."""
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 1, 1]])
    batch = PackedBatch.from_hf_inputs(ids, mask)
    assert batch.cu_seqlens.tolist() == [0, 3, 3, 5]
    assert batch.input_ids.tolist() == [1, 2, 3, 8, 9]
    assert batch.next_tokens()[1].tolist() == [True, True, False, True, False]
    assert torch.equal(batch.unpack(batch.input_ids), torch.tensor([[1, 2, 3], [0, 0, 0], [0, 8, 9]]))
