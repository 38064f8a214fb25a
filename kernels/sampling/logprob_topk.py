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
negative values; -0.0 is first made +0.0, equal as a float), and a row's keys are
    key[v] = ordered(lp[v]) * 2^32 + (V - 1 - v)          int64, distinct within the row
`torch.topk` of distinct keys has one answer, so a row's ids are the same alone, in any batch, chunk
or backend. The rank is a count of a comparison (exact). Both are row-wise and run in row blocks of
at most BLOCK_ELEMENTS keys (the int64 keys cost 8 bytes an element), which bounds memory only.
A NaN log-prob orders above +inf (a NaN with its sign bit set, below -inf), as torch.topk puts it.
"""

from typing import NamedTuple

import torch

from ..checks import check_dim, check_dtype, check_int, check_same_device

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


def order_keys(log_probs: torch.Tensor) -> torch.Tensor:
    """int64 [M, V]: keys whose order is (lp descending, id ascending) read as key descending."""
    vocab = log_probs.shape[1]
    bits = (log_probs + 0.0).view(torch.int32)  # -0.0 + 0.0 = +0.0: equal floats, equal keys
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 in the floats' order
    ids = torch.arange(vocab, dtype=torch.int64, device=log_probs.device)  # [V]
    low = (vocab - 1) - ids  # the lower id, the larger key
    return ordered.to(torch.int64) * (1 << 32) + low


def top_k_ids(log_probs: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [M, k]: each row's k largest log-probs' ids, ties to the lower id (module docstring)."""
    _check_log_probs(log_probs)
    n_rows, vocab = log_probs.shape
    if not isinstance(k, int) or not 0 <= k <= vocab:
        raise ValueError(f"k must be an int in [0, {vocab}], got {k!r}")
    out = torch.empty(n_rows, k, dtype=torch.int64, device=log_probs.device)
    if k == 0:
        return out
    for rows in _row_blocks(n_rows, vocab):
        out[rows] = torch.topk(order_keys(log_probs[rows]), k, dim=-1, sorted=True).indices
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
