"""Triton sampling step (the CUDA path of `sample.sample_tokens`): the draw, the sampled token's
log-prob and rank, and the log-probs only when asked, without writing and re-reading [M, V] log-probs.

The composition it replaces (`sample.sample_composed` spells it): log_probs = log_softmax(logits, tau)
written to memory, then argmax or gumbel_argmax reading it back, then vLLM's gather and rank reading it
again. At 256 rows of a 151,936-token vocabulary that is 156 MB read four times and written once a
decode step; here the logits are read twice (three times with the rank) and nothing [M, V] is written.

Per row of V fp32 logits z, tau its requested temperature (`effective_tau` applied in each kernel,
as in logprob_triton), in (row, chunk) programs over logprob_triton's 8,192-column chunks:
  1. `chunk_lse_kernel` (logprob_triton's own): each chunk's (max, sum of exp).
  2. `_sample_chunk_kernel`: lse = `row_lse` of the row's chunks (the log-prob kernels' function: the
     same partials combined in the same order), then per column lp[v] = div_rn(z[v], tau) - lse,
     log_softmax_triton's expression, so its bits (written out in the "log_probs" output only), and
     the value drawn on: lp[v] for greedy rows, lp[v] + g(seed, position, v) for sampled rows
     (gumbel_triton's `gumbel_value`, gumbel.py's noise); the chunk's first maximum (value, id).
  3. `_sample_pick_kernel`, one program per row: the chunks in order, a later one taken only when
     strictly greater, so the token is the row's first maximum (torch.argmax's and
     gumbel_argmax_triton's choice; only NaN logits, which torch.argmax would pick, are never
     taken); then lp[token], recomputed from z by the same expression.
  4. ("token_log_probs" output) `_rank_kernel`: each chunk's count of lp[v] >= lp[token] (vLLM's rank
     of the sampled token), added into the row's rank atomically: integer addition, so any order
     gives the same count.
Invariant: every step is row-wise, and a row's token, log-prob and rank depend on its own logits,
temperature, seed and position only (never the batch, never the chunk programs' order), and equal
the composition's bit for bit.
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from . import gumbel
from .gumbel_triton import fold_first_max, gumbel_value, noise_row_key, pick_first_max
from .logprob_triton import (
    LSE_WARPS,
    TRITON_CHUNK_BLOCKS,
    TRITON_VOCAB_BLOCK,
    TRITON_VOCAB_CHUNK,
    chunk_lse_kernel,
    effective_tau,
    row_lse,
)

# `draw` codes (the kernels' DRAW constexpr: one compilation per draw, never a per-row branch on it).
DRAW_CODES = {"greedy": 0, "sampled": 1, "mixed": 2}
# Warps of the chunk-sampling and rank programs: speed only (a first maximum with ties to the lowest id
# and an integer count are the same whatever the tree). The chunk lse keeps logprob_triton's 16, which
# shape its sums. H200, 256 x 151,936: sampling 56 / 61 / 88 us at 4 / 8 / 16 warps without noise,
# 182 / 179 / 191 with it; 8 is the best or near it at 16 and 256 rows (see docs/results.md#sampler-warps).
_SAMPLE_WARPS = 8


@triton.jit
def _sample_chunk_kernel(
    Z,
    TAU,
    SEEDS,
    POS,
    PART,  # [M, NUM_CHUNKS, 2] from chunk_lse_kernel
    LOGP,  # [M, V] fp32 written when WRITE (may be Z itself: each element is read, then written)
    BEST_VAL,  # fp32 [M, NUM_CHUNKS]: each chunk's first maximum
    BEST_IDX,  # int64 [M, NUM_CHUNKS]: its id
    stride_z,
    stride_lp,
    V,
    BLOCK: tl.constexpr,  # TRITON_VOCAB_BLOCK: the chunks are logprob_triton's
    CHUNK_BLOCKS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # cdiv(V, TRITON_VOCAB_CHUNK)
    DRAW: tl.constexpr,  # 0 greedy, 1 sampled, 2 mixed (greedy where the requested tau is 0)
    WRITE: tl.constexpr,  # write lp (the "log_probs" output)
    UNIFORM_BITS: tl.constexpr,  # gumbel.UNIFORM_BITS: the noise's definition
):
    """Program (row, chunk): the row's lse, then lp and the drawn value per column; the chunk's first
    maximum (module docstring, step 2)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    z_row = Z + row * stride_z
    tau_req = tl.load(TAU + row)
    tau = effective_tau(tau_req)
    lse = row_lse(PART + row * NUM_CHUNKS * 2, NUM_CHUNKS)
    if DRAW != 0:
        row_key = noise_row_key(SEEDS, POS, row)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for b in range(CHUNK_BLOCKS):
        start = (chunk * CHUNK_BLOCKS + b).to(tl.int64) * BLOCK
        offs = start + lanes
        mask = offs < V
        lp = tl.math.div_rn(tl.load(z_row + offs, mask=mask, other=0.0), tau) - lse
        if WRITE:
            tl.store(LOGP + row * stride_lp + offs, lp, mask=mask)
        val = lp
        if DRAW == 1:
            val = lp + gumbel_value(row_key, offs, UNIFORM_BITS)
        if DRAW == 2:
            val = tl.where(tau_req == 0, lp, lp + gumbel_value(row_key, offs, UNIFORM_BITS))
        best_val, best_idx = fold_first_max(tl.where(mask, val, float("-inf")), lanes, start, best_val, best_idx)
    tl.store(BEST_VAL + row * NUM_CHUNKS + chunk, best_val)
    tl.store(BEST_IDX + row * NUM_CHUNKS + chunk, best_idx)


@triton.jit
def _sample_pick_kernel(
    Z,
    TAU,
    PART,
    BEST_VAL,
    BEST_IDX,
    TOKENS,  # int64 [M]
    TOKEN_LP,  # fp32 [M], written when TOKEN_LOG_PROBS
    stride_z,
    NUM_CHUNKS: tl.constexpr,
    TOKEN_LOG_PROBS: tl.constexpr,  # also write lp[token] (the "token_log_probs" output)
):
    """The row's token: the chunks in order, a later one taken only when strictly greater; then
    lp[token] = div_rn(z[token], tau) - lse, the chunk kernel's expression."""
    row = tl.program_id(0).to(tl.int64)
    best_idx = pick_first_max(BEST_VAL, BEST_IDX, row, NUM_CHUNKS)
    tl.store(TOKENS + row, best_idx)
    if TOKEN_LOG_PROBS:
        tau = effective_tau(tl.load(TAU + row))
        lse = row_lse(PART + row * NUM_CHUNKS * 2, NUM_CHUNKS)
        tl.store(TOKEN_LP + row, tl.math.div_rn(tl.load(Z + row * stride_z + best_idx), tau) - lse)


@triton.jit
def _rank_kernel(
    Z,
    TAU,
    PART,
    TOKEN_LP,
    RANKS,  # int64 [M], zeroed before the launch
    stride_z,
    V,
    BLOCK: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    """Program (row, chunk): #{v in the chunk: lp[v] >= lp[token]}, added to the row's rank."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    tau = effective_tau(tl.load(TAU + row))
    lse = row_lse(PART + row * NUM_CHUNKS * 2, NUM_CHUNKS)
    token_lp = tl.load(TOKEN_LP + row)
    cols = chunk * (CHUNK_BLOCKS * BLOCK) + tl.arange(0, BLOCK)
    count = tl.full([BLOCK], 0, tl.int32)
    for b in range(CHUNK_BLOCKS):
        offs = b * BLOCK + cols
        mask = offs < V
        lp = tl.math.div_rn(tl.load(Z + row * stride_z + offs, mask=mask, other=0.0), tau) - lse
        count += tl.where(mask & (lp >= token_lp), 1, 0)
    tl.atomic_add(RANKS + row, tl.reduce(count, 0, _sum_combine).to(tl.int64))


def sample_triton(logits, tau, seeds, positions, draw, output, tokens, token_log_probs, ranks, log_probs):
    """Run steps 1-4 (inputs and outputs checked and allocated by `sample.sample_tokens`): tau fp32
    [M] requested temperatures; `draw` a DRAW_CODES key; the outputs' buffers for `output`."""
    n_rows, vocab = logits.shape
    if n_rows == 0:
        return
    n_chunks = triton.cdiv(vocab, TRITON_VOCAB_CHUNK)
    dev = logits.device
    part = torch.empty(n_rows, n_chunks, 2, dtype=torch.float32, device=dev)
    best_val = torch.empty(n_rows, n_chunks, dtype=torch.float32, device=dev)
    best_idx = torch.empty(n_rows, n_chunks, dtype=torch.int64, device=dev)
    sizes = dict(BLOCK=TRITON_VOCAB_BLOCK, CHUNK_BLOCKS=TRITON_CHUNK_BLOCKS, NUM_CHUNKS=n_chunks, num_warps=LSE_WARPS)
    stride_z = logits.stride(0)
    grid = (n_rows, n_chunks)
    chunk_lse_kernel[grid](logits, tau, part, stride_z, vocab, **sizes)
    if draw == "greedy":  # no noise: the seeds and positions are never read
        seeds = positions = tokens
    seeds, positions = seeds.contiguous(), positions.contiguous()
    write = output == "log_probs"
    lp_out = log_probs if write else logits  # unused unless WRITE
    chunked = dict(sizes, num_warps=_SAMPLE_WARPS)
    _sample_chunk_kernel[grid](
        logits, tau, seeds, positions, part, lp_out, best_val, best_idx, stride_z, lp_out.stride(0), vocab,
        DRAW=DRAW_CODES[draw], WRITE=write, UNIFORM_BITS=gumbel.UNIFORM_BITS, **chunked,
    )  # fmt: skip
    with_lp = output == "token_log_probs"
    token_lp = token_log_probs if with_lp else best_val  # unused unless TOKEN_LOG_PROBS
    _sample_pick_kernel[(n_rows,)](
        logits, tau, part, best_val, best_idx, tokens, token_lp, stride_z, NUM_CHUNKS=n_chunks,
        TOKEN_LOG_PROBS=with_lp, num_warps=1,
    )  # fmt: skip
    if with_lp:
        ranks.zero_()
        _rank_kernel[grid](logits, tau, part, token_log_probs, ranks, stride_z, vocab, **chunked)
