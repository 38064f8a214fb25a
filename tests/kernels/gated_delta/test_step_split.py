"""How a cached step's rows go to the kernels (`incremental_cache.split_step`) and the chunks the chunk
kernels take (`incremental_cache.chunk_map`), checked row by row against the rule they state: a
sequence's one row to the decode step; a sequence of more rows to the chunk kernels, in chunks anchored
at multiples of CHUNK from the rows its slot holds on, a chunk that starts with held rows in scratch rows
of its own past the packed rows."""

import random

import pytest
import torch

from vexact_vllm.kernels.gated_delta import incremental_cache as layout


def _random_step(rng: random.Random):
    n = rng.randint(1, 12)
    lengths = [rng.choice([0, 1, 1, 2, rng.randint(1, 300)]) for _ in range(n)]
    context = [rng.choice([0, rng.randint(1, 400), 64 * rng.randint(1, 4)]) for _ in range(n)]
    has_state = [c > 0 or rng.random() < 0.2 for c in context]
    cu = torch.tensor([0] + lengths).cumsum(0)
    return cu, torch.tensor(context), torch.tensor(has_state), lengths


@pytest.mark.parametrize("seed", range(20))
def test_split_follows_the_rows(seed):
    rng = random.Random(seed)
    cu, context, has_state, lengths = _random_step(rng)
    split = layout.split_step(cu.int(), context.int(), has_state, torch.device("cpu"))
    chunk, packed = layout.CHUNK, int(cu[-1])
    expected, scratch = [], packed  # (sequence, packed row of row 0, scratch row of row 0)
    for n, length in enumerate(lengths):
        held = int(context[n]) % chunk if bool(has_state[n]) else 0
        assert int(split.held[n]) == held
        assert bool(split.single[n]) == (length == 1)
        if length < 2:
            continue
        src = int(cu[n]) - held
        while src < int(cu[n + 1]):
            if src < int(cu[n]):  # starts with the slot's rows
                expected.append((n, src, scratch))
                scratch += chunk
            else:
                expected.append((n, src, src))
            src += chunk
    assert split.n_single == lengths.count(1)
    chunks = split.chunks
    assert list(zip(chunks.seq.tolist(), chunks.src.tolist(), chunks.first.tolist())) == expected
    assert chunks.rows == scratch
    for n in range(len(lengths)):  # each sequence's first chunk index
        mine = [i for i, (s, _, _) in enumerate(expected) if s == n]
        if mine:
            assert int(chunks.chunk_start[n]) == mine[0]


def test_training_chunks_are_the_packed_rows():
    """No rows held (training, a fresh prefill): every chunk's scratch rows are its packed rows."""
    cu = torch.tensor([0, 5, 5, 200, 201])
    chunks = layout.chunk_map(cu[:-1], cu[1:])
    assert torch.equal(chunks.first, chunks.src) and chunks.rows == 201
    assert chunks.seq.tolist() == [0, 2, 2, 2, 2, 3] and chunks.src.tolist() == [0, 5, 69, 133, 197, 200]
    assert chunks.chunk_start.tolist() == [0, 1, 1, 5]
