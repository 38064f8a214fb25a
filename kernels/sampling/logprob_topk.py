"""A row's top-k log-probs and a token's rank, the same whatever the batch: what vLLM returns for
`logprobs=k` (the sampled token) and `prompt_logprobs=k` (each prompt token), and what a trainer
computes to compare with it (a distillation teacher's top-k).

Over fp32 log-probs lp [M, V] (`logprob.log_softmax`'s, the one log-prob function):
    top_k_ids(lp, k)[m]       = the k ids of the largest lp[m, v], in the order (lp[m, v] descending,
                                v ascending): an exact tie goes to the lower token id
    token_ranks(lp, t)[m]     = #{v : lp[m, v] >= lp[m, t[m]]}       (vLLM's rank: 1 = the largest)
    score_tokens(lp, t, k)    = ids [M, 1 + k] = (t, top_k_ids), their log-probs, and the ranks of t:
                                the layout of vLLM's `LogprobsTensors`

Invariant: the order is total, so the top-k is one set in one order, whichever algorithm selects
it. Each lp is mapped to an int32 with the same order (its bits, the magnitude bits flipped for
negative values; -0.0 is first made +0.0, equal as a float, by its bits: adding 0.0 would also
turn every NaN into CUDA's one NaN, sign lost, and CUDA's keys would then differ from the CPU's),
and a row's keys are
    key[v] = ordered(lp[v]) * 2^32 + (V - 1 - v)          int64, distinct within the row
A NaN log-prob orders above +inf (a NaN with its sign bit set, below -inf), as torch.topk puts it.

`top_k_ids` selects in two steps. `torch.topk` of the fp32 log-probs gives some k ids whose values
are a row's k largest; with b the smallest of them, when exactly k log-probs of the row are not
below b (no tie across the boundary, no NaN: a NaN is never below b, and b is NaN when the k hold
one), those k ids are the only top-k set.
A row where that fails (an exact tie at the k-th place, a NaN) takes `torch.topk` of its distinct
int64 keys, which has one answer. Either way the k ids are then put in key order (a sort of k keys).
So a row's ids are the same alone, in any batch, chunk or backend; the rank is a count of a
comparison (exact). Reading whether any row needs the keys is a host sync: not for CUDA-graph
capture. Row blocks of at most BLOCK_ELEMENTS elements bound the temporary memory only.
"""

from typing import NamedTuple

import torch

from ..checks import check_dim, check_dtype, check_int, check_same_device

_NEGATIVE_ZERO = -(1 << 31)  # the bits of -0.0 read as an int32

# Keys per row block (int64: 128 MiB); bounds the temporary memory, never changes a result.
BLOCK_ELEMENTS = 1 << 24


class TokenScores(NamedTuple):
    """What `score_tokens` returns (vLLM's `LogprobsTensors` layout)."""

    ids: torch.Tensor  # int64 [M, 1 + k]: the scored token, then the top-k ids
    log_probs: torch.Tensor  # fp32 [M, 1 + k]: lp at those ids
    ranks: torch.Tensor  # int64 [M]: the scored token's rank


def _check_log_probs(log_probs: torch.Tensor) -> None:
    check_dtype("log_probs", log_probs, (torch.float32,))
    check_dim("log_probs", log_probs, 2, "[M, V]")


def _check_tokens(tokens: torch.Tensor, n_rows: int) -> None:
    """int [M] (values not read: no host sync; an id outside [0, V) fails in the gather)."""
    check_int("tokens", tokens)
    if tuple(tokens.shape) != (n_rows,):
        raise ValueError(f"tokens must have shape ({n_rows},), got {tuple(tokens.shape)}")


def _row_blocks(n_rows: int, vocab: int):
    step = max(1, BLOCK_ELEMENTS // max(vocab, 1))
    for r0 in range(0, n_rows, step):
        yield slice(r0, r0 + step)


def order_keys(log_probs: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64, log_probs' shape: the keys of log-probs at token ids `ids` (int64, broadcast against
    log_probs) of a V = `vocab` vocabulary, whose order is (lp descending, id ascending) read as key
    descending."""
    bits = log_probs.view(torch.int32)  # no arithmetic: CUDA would give every NaN one bit pattern
    bits = bits.masked_fill(bits == _NEGATIVE_ZERO, 0)  # -0.0 as +0.0: equal floats, equal keys
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 in the floats' order
    return ordered.to(torch.int64) * (1 << 32) + ((vocab - 1) - ids)  # the lower id, the larger key


def top_k_ids(log_probs: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [M, k]: each row's k largest log-probs' ids, ties to the lower id (module docstring)."""
    _check_log_probs(log_probs)
    n_rows, vocab = log_probs.shape
    if not isinstance(k, int) or not 0 <= k <= vocab:
        raise ValueError(f"k must be an int in [0, {vocab}], got {k!r}")
    if k == 0 or n_rows == 0:
        return torch.empty(n_rows, k, dtype=torch.int64, device=log_probs.device)
    values, ids = torch.topk(log_probs, k, dim=-1, sorted=False)  # [M, k]: one top-k set, torch's pick
    boundary = values.min(dim=-1, keepdim=True).values  # [M, 1]: the k-th largest
    below = torch.empty(n_rows, dtype=torch.int64, device=log_probs.device)
    for rows in _row_blocks(n_rows, vocab):  # a NaN is never below b, and b is NaN where the k hold one
        torch.sum(log_probs[rows] < boundary[rows], dim=-1, out=below[rows])
    undecided = below != vocab - k  # more than k not below b: a tie at the k-th place, or a NaN
    if bool(undecided.any()):  # a tie across the k-th place or a NaN: the row's distinct keys decide
        redo = undecided.nonzero()[:, 0]
        ids[redo] = _key_top_k(log_probs[redo], k)
    keys = order_keys(log_probs.gather(1, ids), ids, vocab)  # [M, k], distinct within a row
    return ids.gather(1, torch.sort(keys, dim=-1, descending=True).indices)


def _key_top_k(log_probs: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [M, k]: the k largest keys' ids, in row blocks (the int64 keys cost 8 bytes an element)."""
    n_rows, vocab = log_probs.shape
    out = torch.empty(n_rows, k, dtype=torch.int64, device=log_probs.device)
    ids = torch.arange(vocab, dtype=torch.int64, device=log_probs.device)  # [V]
    for rows in _row_blocks(n_rows, vocab):
        out[rows] = torch.topk(order_keys(log_probs[rows], ids, vocab), k, dim=-1, sorted=False).indices
    return out


def token_ranks(log_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """int64 [M]: #{v : lp[m, v] >= lp[m, tokens[m]]}, vLLM's rank of a token (1 = the largest)."""
    _check_log_probs(log_probs)
    _check_tokens(tokens, log_probs.shape[0])
    check_same_device(log_probs=log_probs, tokens=tokens)
    token_lp = log_probs.gather(1, tokens.long()[:, None])  # [M, 1]
    out = torch.empty(log_probs.shape[0], dtype=torch.int64, device=log_probs.device)
    for rows in _row_blocks(*log_probs.shape):
        torch.sum(log_probs[rows] >= token_lp[rows], dim=-1, out=out[rows])
    return out


def score_tokens(log_probs: torch.Tensor, tokens: torch.Tensor, k: int) -> TokenScores:
    """`tokens`' log-probs and ranks with each row's top-k (module docstring): ids [M, 1 + k] =
    (tokens, top_k_ids(lp, k)), their log-probs gathered from `log_probs`, and the ranks of `tokens`."""
    ranks = token_ranks(log_probs, tokens)  # checks the inputs first
    ids = torch.cat((tokens.long()[:, None], top_k_ids(log_probs, k)), dim=1)  # [M, 1 + k]
    return TokenScores(ids, log_probs.gather(1, ids), ranks)
