"""Triton Gumbel-max sampling (the CUDA path of `sample.gumbel_argmax`).

token[m] = argmax_v(log_probs[m, v] + g(seeds[m], positions[m], v)), ties to the lowest v, with the
hash and the uniform of `gumbel.py` (its constants) and g = -log(-log(u)) in fp32: the row key in
int64 arithmetic (wrapping mod 2^64, values masked to 63 bits, as the torch path computes it), the
per-id hash in uint32 arithmetic (wrapping mod 2^32: the torch path's masked int64 products have the
same low 32 bits), so the noise has the torch path's bits up to `log`'s rounding.

The vocabulary is cut into chunks of GUMBEL_CHUNK_BLOCKS blocks of GUMBEL_BLOCK ids; one program per
(row, chunk) walks its chunk's blocks in index order, generating the noise in registers (the torch path
materialises [rows, V] int64 tensors, tens of passes over memory per decode step) and keeping the
chunk's first maximum (value, id); then one program per row scans the chunks in order, taking a
chunk only when its value is strictly greater. Both scans keep the first maximum, so the token is
the vocabulary's first maximum whatever GUMBEL_CHUNK_BLOCKS is (speed only: a decode batch of 16
rows gives 16 x 19 programs instead of 16): a row's token depends on its own log-probs, seed and position
only, never on the batch. Triton's `log` may round differently from torch's, so
the two backends can pick different tokens where two candidates tie to within an ulp; a rollout
uses one backend throughout (the trainer does not sample).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _argmax_combine_tie_break_left

from . import gumbel

# Token ids per block of a chunk program (its registers' vector).
GUMBEL_BLOCK = 2048
GUMBEL_CHUNK_BLOCKS = 4  # blocks per (row, chunk) program: 19 chunks of a 151,936-id vocabulary
_NUM_WARPS = 8
# The hash constants of gumbel.py, as compile-time constants of the kernels.
_C1 = tl.constexpr(gumbel.MIX_C1)
_C2 = tl.constexpr(gumbel.MIX_C2)
_GOLDEN = tl.constexpr(gumbel.GOLDEN)
_MASK63 = tl.constexpr(gumbel.MASK63)
_MASK32 = tl.constexpr(gumbel.MASK32)
_H1 = tl.constexpr(gumbel.HASH_H1)
_H2 = tl.constexpr(gumbel.HASH_H2)


@triton.jit
def _mix63(x):
    """splitmix64's finalizer on 63 bits (x >= 0: `>>` is then a logical shift)."""
    x = ((x ^ (x >> 30)) * _C1) & _MASK63
    x = ((x ^ (x >> 27)) * _C2) & _MASK63
    return x ^ (x >> 31)


@triton.jit
def noise_row_key(SEEDS, POS, row):
    """The row's noise key, uint32: mix(mix(seed ^ GOLDEN) ^ position) mod 2^32, seed and position
    on 63 bits."""
    seed = tl.load(SEEDS + row).to(tl.int64) & _MASK63
    pos = tl.load(POS + row).to(tl.int64) & _MASK63
    return (_mix63(_mix63(seed ^ _GOLDEN) ^ pos) & _MASK32).to(tl.uint32)


@triton.jit
def _hash32(x):
    """The per-id 32-bit finalizer on uint32 (products wrap mod 2^32; `>>` is a logical shift)."""
    x = (x ^ (x >> 16)) * tl.full([], _H1, tl.uint32)
    x = (x ^ (x >> 15)) * tl.full([], _H2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def gumbel_value(row_key, ids, UNIFORM_BITS: tl.constexpr):
    """g = -log(-log(u)) of ids (int64 < 2^32), u = (top UNIFORM_BITS of hash32(row_key ^ id) + 0.5) / 2^bits."""
    h = _hash32(row_key ^ ids.to(tl.uint32))
    u = ((h >> (32 - UNIFORM_BITS)).to(tl.float32) + 0.5) * (2.0**-UNIFORM_BITS)
    return -tl.log(-tl.log(u))


@triton.jit
def fold_first_max(val, lanes, start, best_val, best_idx):
    """(best_val, best_idx) after a block of values `val` at ids start + lanes: the block's first
    maximum, taken only when strictly greater (an earlier block keeps a tie). The argmax is
    tl.argmax(val, 0, tie_break_left=True) spelled as its reduce over the lanes (interpreter-safe: the
    interpreter answers with the lane, so the lane is what both modes reduce)."""
    block_max, lane = tl.reduce((val, lanes), 0, _argmax_combine_tie_break_left)
    take = block_max > best_val
    return tl.where(take, block_max, best_val), tl.where(take, start + lane, best_idx)


@triton.jit
def pick_first_max(BEST_VAL, BEST_IDX, row, NUM_CHUNKS):
    """The row's id: its chunks' first maxima scanned in chunk order, a later one taken only when
    strictly greater, so the row's first maximum whatever the chunking."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for c in range(NUM_CHUNKS):
        val = tl.load(BEST_VAL + row * NUM_CHUNKS + c)
        take = val > best_val
        best_idx = tl.where(take, tl.load(BEST_IDX + row * NUM_CHUNKS + c), best_idx)
        best_val = tl.where(take, val, best_val)
    return best_idx


@triton.jit
def _gumbel_chunk_kernel(
    LOGP,
    SEEDS,
    POS,
    BEST_VAL,  # fp32 [M, NUM_CHUNKS]: each chunk's first maximum
    BEST_IDX,  # int64 [M, NUM_CHUNKS]: its id
    THR,  # fp32 [M] truncation thresholds, or a dummy when HAS_THRESHOLD is False
    stride_l,
    V,
    NUM_CHUNKS,
    BLOCK: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,  # a different kernel with and without truncation, never per row
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_key = noise_row_key(SEEDS, POS, row)
    cols = tl.arange(0, BLOCK).to(tl.int64)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    if HAS_THRESHOLD:  # the row's threshold in every lane (a vector load: interpreter-safe)
        thr = tl.load(THR + row + cols * 0)
    for b in range(CHUNK_BLOCKS):
        start = (chunk * CHUNK_BLOCKS + b).to(tl.int64) * BLOCK
        offs = start + cols
        mask = offs < V
        lp = tl.load(LOGP + row * stride_l + offs, mask=mask, other=float("-inf"))
        if HAS_THRESHOLD:  # truncated sampling: ids below the threshold cannot win
            lp = tl.where(lp >= thr, lp, float("-inf"))
        val = tl.where(mask, lp + gumbel_value(row_key, offs, UNIFORM_BITS), float("-inf"))
        best_val, best_idx = fold_first_max(val, cols, start, best_val, best_idx)
    tl.store(BEST_VAL + row * NUM_CHUNKS + chunk, best_val)
    tl.store(BEST_IDX + row * NUM_CHUNKS + chunk, best_idx)


@triton.jit
def _gumbel_pick_kernel(BEST_VAL, BEST_IDX, OUT, NUM_CHUNKS):
    """The row's token (`pick_first_max`)."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(OUT + row, pick_first_max(BEST_VAL, BEST_IDX, row, NUM_CHUNKS))


def gumbel_argmax_triton(
    log_probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    threshold: torch.Tensor | None = None,
    chunk_blocks: int = GUMBEL_CHUNK_BLOCKS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [M] tokens (inputs already checked by `sample.gumbel_argmax`), in `out` when given;
    `chunk_blocks`: blocks per chunk (speed only, the tokens are the same for every value)."""
    n_rows, vocab = log_probs.shape
    out = torch.empty(n_rows, dtype=torch.int64, device=log_probs.device) if out is None else out
    if n_rows:
        chunks = triton.cdiv(vocab, chunk_blocks * GUMBEL_BLOCK)
        best_val = torch.empty(n_rows, chunks, dtype=torch.float32, device=log_probs.device)
        best_idx = torch.empty(n_rows, chunks, dtype=torch.int64, device=log_probs.device)
        thr = threshold.contiguous() if threshold is not None else log_probs
        _gumbel_chunk_kernel[(n_rows, chunks)](
            log_probs, seeds.contiguous(), positions.contiguous(), best_val, best_idx, thr,
            log_probs.stride(0), vocab, chunks, BLOCK=GUMBEL_BLOCK, CHUNK_BLOCKS=chunk_blocks,
            UNIFORM_BITS=gumbel.UNIFORM_BITS, HAS_THRESHOLD=threshold is not None, num_warps=_NUM_WARPS,
        )  # fmt: skip
        _gumbel_pick_kernel[(n_rows,)](best_val, best_idx, out, chunks, num_warps=1)
    return out
