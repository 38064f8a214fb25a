"""The bitwise contract on the training side (bf16 checkpoints, torch.equal, no tolerance): a
sequence's per-token log-probs do not depend on how it is batched, packed, padded or ordered, nor on
whether they come from the fused `packed_log_probs` or from `forward` logits + `token_log_probs`."""

import contextlib

import pytest
import torch

from vexact_vllm.kernels import KEY_TILE, token_log_probs
from vexact_vllm.model_patches import PackedBatch

ARCHS = ["qwen3", "qwen2", "llama"]
VOCAB = 448
LENGTHS = (5, 23, KEY_TILE + 6, 12)  # one sequence spans two attention key tiles


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


@contextlib.contextmanager
def _threads(n: int):
    original = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(original)


def _split(packed_logp: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """[T] packed log-probs -> one [n-1] tensor per sequence; the last row of each must be exactly 0."""
    out, cu = [], batch.cu_seqlens.tolist()
    for a, b in zip(cu, cu[1:]):
        assert packed_logp[b - 1].item() == 0.0
        out.append(packed_logp[a : b - 1])
    return out


def _packed(model, seqs, temperature=1.0) -> list[torch.Tensor]:
    batch = PackedBatch.from_sequences(seqs)
    return _split(model.packed_log_probs(batch, temperature), batch)


def _from_logits(logits: torch.Tensor, seq: list[int], temperature=1.0) -> torch.Tensor:
    """logits [n, V] of one sequence -> [n-1] log-probs of its next tokens, through the kernel."""
    targets = torch.tensor(seq[1:])
    return token_log_probs(logits[: len(seq) - 1].contiguous(), targets, temperature)


def _assert_all_equal(results: dict[str, list[torch.Tensor]], seqs):
    reference_name, reference = next(iter(results.items()))
    for name, got in results.items():
        for i, seq in enumerate(seqs):
            assert got[i].dtype == torch.float32 and got[i].shape == (len(seq) - 1,), (name, i)
            assert torch.equal(got[i], reference[i]), (
                f"sequence {i} (length {len(seq)}): {name} differs from {reference_name}, "
                f"max |diff| {(got[i] - reference[i]).abs().max().item():.3g}"
            )


@pytest.mark.parametrize("arch", ARCHS)
def test_log_probs_bitwise_invariant(load_model, sequences, arch):
    model = load_model(arch, torch.bfloat16, True)
    seqs = sequences
    n = len(seqs)
    results = {}
    # (a) all packed in one batch, with autograd on (as a trainer runs it), on two threads
    with _threads(2):
        results["packed_all"] = [t.detach() for t in _packed(model, seqs)]
    with torch.no_grad():
        # (b) each sequence alone
        results["alone"] = [_packed(model, [s])[0] for s in seqs]
        # (c) packs of two, in another order: [3, 1], [2, 0]
        got = [None] * n
        for pair in ((3, 1), (2, 0)):
            for i, logp in zip(pair, _packed(model, [seqs[i] for i in pair])):
                got[i] = logp
        results["packs_of_2_reordered"] = got
        # (d) forward() on a padded [B, L] batch, rows 0 and 2 right-padded, rows 1 and 3 left-padded
        length = max(LENGTHS) + 3
        ids = torch.zeros(n, length, dtype=torch.long)
        mask = torch.zeros(n, length, dtype=torch.long)
        starts = [0 if i % 2 == 0 else length - len(s) for i, s in enumerate(seqs)]
        for i, (s, start) in enumerate(zip(seqs, starts)):
            ids[i, start : start + len(s)] = torch.tensor(s)
            mask[i, start : start + len(s)] = 1
        logits = model(ids, attention_mask=mask).logits  # [B, L, V] fp32
        assert logits.dtype == torch.float32
        results["forward_padded"] = [
            _from_logits(logits[i, start : start + len(s)], s) for i, (s, start) in enumerate(zip(seqs, starts))
        ]
        # (e) forward() on one packed row [1, T] with position_ids that restart at 0 per sequence
        flat = torch.tensor([[t for s in seqs for t in s]])
        position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
        logits = model(flat, position_ids=position_ids).logits[0]  # [T, V]
        offsets = [0, *torch.cumsum(torch.tensor(LENGTHS), 0).tolist()]
        results["forward_packed_position_ids"] = [
            _from_logits(logits[a:b], s) for a, b, s in zip(offsets, offsets[1:], seqs)
        ]
    _assert_all_equal(results, seqs)
    for logp in results["packed_all"]:
        assert bool(torch.isfinite(logp).all()) and bool((logp < 0).all())


@pytest.mark.parametrize("arch", ARCHS)
def test_temperature_bitwise(load_model, sequences, arch):
    """packed_log_probs(batch, 0.7) == token_log_probs(forward logits, targets, 0.7), bit for bit."""
    model = load_model(arch, torch.bfloat16, True)
    seqs = sequences[:3]
    batch = PackedBatch.from_sequences(seqs)
    targets, valid = batch.next_tokens()
    with torch.no_grad():
        fused = model.packed_log_probs(batch, 0.7)
        fused_t1 = model.packed_log_probs(batch, 1.0)
        flat = batch.input_ids[None]
        logits = model(flat, position_ids=batch.positions[None]).logits[0]  # [T, V]
    unfused = torch.where(valid, token_log_probs(logits, targets, 0.7), torch.zeros_like(fused))
    assert torch.equal(fused, unfused)
    assert torch.equal(fused_t1, torch.where(valid, token_log_probs(logits, targets, 1.0), torch.zeros_like(fused)))
    # temperature is applied: fp32 logits / tau, then fp32 log-softmax (accuracy check vs torch)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(fused[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert not torch.equal(fused[valid], fused_t1[valid])
    assert bool((fused[valid] != fused_t1[valid]).all())
