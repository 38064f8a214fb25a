"""How a cached step's rows go to the kernels (`incremental_cache.split_step`), checked row by row against
the rule it states: a sequence's rows up to its chunk boundary (or its one row at a boundary) to the step
kernels (one row: the decode step), the rest in chunks of CHUNK from there to the chunk kernels."""

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
    chunk = layout.CHUNK
    expected_chunks = []
    for n, length in enumerate(lengths):
        held = int(context[n]) % chunk if bool(has_state[n]) else 0
        assert int(split.held[n]) == held
        if held == 0 and length == 1:
            head = 1
        else:
            head = min(length, (chunk - held) % chunk)
        assert int(split.head[n]) == head, (n, length, held)
        assert bool(split.single[n]) == (head == 1)
        start = int(cu[n]) + head
        while start < int(cu[n + 1]):
            expected_chunks.append((n, start))
            start += chunk
    assert split.n_single == sum(int(h) == 1 for h in split.head)
    assert split.n_multi == sum(int(h) > 1 for h in split.head)
    seq, first, chunk_start = split.chunks
    assert list(zip(seq.tolist(), first.tolist())) == expected_chunks
    for n in range(len(lengths)):  # each sequence's first chunk index
        mine = [i for i, (s, _) in enumerate(expected_chunks) if s == n]
        if mine:
            assert int(chunk_start[n]) == mine[0]
