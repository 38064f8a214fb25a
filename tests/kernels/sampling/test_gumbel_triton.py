"""Triton Gumbel-max sampling: the interpreter on CPU tensors, the compiled kernel on CUDA."""

import importlib

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import

from vexact_vllm.kernels import gumbel_argmax, log_softmax  # noqa: E402
from vexact_vllm.kernels.sampling.gumbel import gumbel_noise, gumbel_uniform  # noqa: E402

MODULE = "vexact_vllm.kernels.sampling.gumbel_triton"
BLOCK = importlib.import_module(MODULE).GUMBEL_BLOCK
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gk(import_interpreted):
    return import_interpreted(MODULE)


def _inputs(rows, vocab, device="cpu"):
    log_probs = log_softmax(torch.randn(rows, vocab, device=device) * 3, 1.0)
    seeds = torch.randint(-(2**62), 2**62, (rows,), device=device)
    positions = torch.randint(0, 40000, (rows,), device=device)
    return log_probs, seeds, positions


def _reference(log_probs, seeds, positions):
    """argmax of log_probs + the torch noise (same hash; log may differ by an ulp)."""
    return (log_probs + gumbel_noise(seeds, positions, log_probs.shape[1])).argmax(-1)


def _numpy_noise(seeds, positions, vocab):
    """The noise as the interpreter computes it: the hash's uniform (logprob's definition), numpy's
    fp32 log."""
    u = gumbel_uniform(seeds, positions, vocab).numpy()
    return torch.from_numpy(-np.log(-np.log(u)))


@pytest.mark.parametrize("vocab", [7, BLOCK, BLOCK + 5, 2 * BLOCK + 37])
def test_interpreted_matches_torch_and_is_row_invariant(gk, vocab):
    log_probs, seeds, positions = _inputs(6, vocab)
    tokens = gk.gumbel_argmax_triton(log_probs, seeds, positions)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, _reference(log_probs, seeds, positions))
    for i in range(6):  # a row alone = the row in the batch
        assert torch.equal(gk.gumbel_argmax_triton(log_probs[i : i + 1], seeds[i : i + 1], positions[i : i + 1]),
                           tokens[i : i + 1])  # fmt: skip


def test_interpreted_ties_go_to_the_lowest_id_across_blocks(gk):
    vocab = 2 * BLOCK + 3
    log_probs = torch.full((1, vocab), -1e30)
    seeds, positions = torch.tensor([5]), torch.tensor([9])
    noise = gumbel_noise(seeds, positions, vocab)[0]
    # Two ids in different blocks with log_prob + noise equal: the first must win.
    a, b = 3, BLOCK + 11
    log_probs[0, a] = 0.0
    log_probs[0, b] = (noise[a] - noise[b]).item()
    if log_probs[0, b] + noise[b] != log_probs[0, a] + noise[a]:
        pytest.skip("the fp32 sums of this draw do not tie exactly")  # never for this seed/position
    assert gk.gumbel_argmax_triton(log_probs, seeds, positions).item() == a


@pytest.mark.parametrize("threshold", [False, True])
def test_interpreted_token_does_not_depend_on_the_chunking(gk, threshold):
    """Chunks of 1, 2, 3 blocks or one chunk for the whole vocabulary: the same tokens, ties across
    chunk boundaries included (a row whose maximum repeats in later chunks keeps the first id)."""
    vocab = 5 * BLOCK + 77
    torch.manual_seed(0)
    log_probs, seeds, positions = _inputs(5, vocab)
    noise = gumbel_noise(seeds, positions, vocab)
    numpy_noise = _numpy_noise(seeds, positions, vocab)
    gen = torch.Generator().manual_seed(3)
    for row in (1, 3):  # plant the same value + noise at ids in different chunks
        top = (log_probs[row] + noise[row]).max() + 1.0
        # ids in random order whose planted sum rounds back to `top` exactly (most do) and whose noise
        # the interpreter's numpy log gives as torch's does (it may round an ulp apart), four of them
        exact = [i for i in torch.randperm(vocab, generator=gen)[:64].tolist()
                 if (top - noise[row, i]) + noise[row, i] == top and numpy_noise[row, i] == noise[row, i]][:4]  # fmt: skip
        assert len(exact) == 4
        for i in exact:
            log_probs[row, i] = top - noise[row, i]
    thr = log_probs.quantile(0.5, dim=1) if threshold else None
    tokens = [gk.gumbel_argmax_triton(log_probs, seeds, positions, thr, chunk_blocks=c) for c in (1, 2, 3, 100)]
    assert all(torch.equal(t, tokens[-1]) for t in tokens[:-1]), tokens
    full = log_probs + noise
    assert (full[3] == full[3].max()).sum() == 4  # exact ties, in several chunks for most draws
    if thr is not None:
        full = torch.where(log_probs >= thr[:, None], full, float("-inf"))
    assert torch.equal(tokens[-1], full.argmax(-1))  # torch.argmax: the first maximum


@pytest.mark.cuda
@requires_cuda
def test_cuda_batch_invariant_and_close_to_torch():
    log_probs, seeds, positions = _inputs(300, 151936, "cuda")
    tokens = gumbel_argmax(log_probs, seeds, positions)  # the dispatch picks the Triton kernel on CUDA
    for rows in (slice(0, 1), slice(17, 18), slice(5, 70), slice(299, 300)):
        assert torch.equal(gumbel_argmax(log_probs[rows], seeds[rows], positions[rows]), tokens[rows])
    perm = torch.randperm(300, device="cuda")
    assert torch.equal(gumbel_argmax(log_probs[perm], seeds[perm], positions[perm]), tokens[perm])
    agree = (tokens == _reference(log_probs, seeds, positions)).float().mean().item()
    assert agree > 0.99  # the same hash; only ulp-level ties of torch's vs Triton's log can differ


def test_interpreted_writes_into_out(gk):
    """`gumbel_argmax_triton(..., out=)` (the sampler graph's static tokens): the same tokens, in the
    given rows of a larger buffer only."""
    log_probs, seeds, positions = _inputs(5, BLOCK + 9)
    buf = torch.full((7,), -1, dtype=torch.int64)
    gk.gumbel_argmax_triton(log_probs, seeds, positions, out=buf[:5])
    assert torch.equal(buf[:5], gk.gumbel_argmax_triton(log_probs, seeds, positions))
    assert torch.equal(buf[5:], torch.full((2,), -1, dtype=torch.int64))
