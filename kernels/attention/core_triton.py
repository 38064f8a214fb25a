"""The shared core of the Triton (CUDA) attention: one position-anchored reduction order for training
and inference, in @triton.jit routines that every entry kernel calls.

Math, for a query q at absolute position p, query head h reading kv head h // G (G = Hq / Hkv),
c = scale * log2(e) (folded once, on the host, identically for every entry point):
    keys in tiles of BLOCK_N = KEY_TILE = 64 anchored at position 0: tile t = positions 64t .. 64t + 63
    m = -inf, l = 0, acc = 0
    for t = 0, 1, ..., (largest query position of the program's row tile) // 64, in order:
        s_j   = dot(q, k_j)            (fp32 accumulate), s_j = -inf for j > p or j >= seq_len
        m'    = max(m, c * max_j s_j)
        alpha = exp2(m - m'),  e_j = exp2(fma(s_j, c, -m'))
        l     = fma(l, alpha, sum_j e_j),  acc = acc * alpha + dot(e.to(v.dtype), v),  m = m'
    out = (acc / l).to(q.dtype);  lse = m + log2(l)  (log2 units; training saves it for the backward)

Invariant: every query runs this loop in ONE @triton.jit routine, `attend_rows`, called by both entry
kernels (`varlen_triton._varlen_fwd_kernel` for training, `paged_triton._paged_fwd_kernel`
for prefill, chunked prefill and decode) with the same BLOCK_M x BLOCK_N x BLOCK_D dot shapes,
num_warps and num_stages (one config per head size, `FWD_CONFIGS`), so the MMA shape never depends on
the batch. The entry kernels differ only in where the K/V rows come from (packed rows vs
block_table-resolved cache slots) and in which (token, head) pairs fill the BLOCK_M rows; rows of a
dot are independent, so neither changes a row's bits. No split-KV unless asked for (below): tiles
0..p // 64 are reduced in order by one program. A tile that lies entirely past a row's position (a
neighbouring row in the same tile reaches further) is a bitwise no-op for that row: its scores are
all -inf, so m' = m, alpha = exp2(0) = 1, e = 0 (and the K/V rows past the sequence are loaded as 0,
so 0 * v = 0: no NaN from unused cache slots). Hence out(p, h) depends only on q[p, h] and K/V at
positions 0..p: not on the batch, the chunking, the block size or the block table. Tiles wholly at
or below every row's position skip the (then inert) masks; an element's arithmetic is the same with
or without them. The fused multiply-adds are explicit (`tl.fma`) and the launches disable FP
contraction, so no compiler choice can differ between the entry kernels.

Rows of a program's tile: row r holds token first + r // G, query head kv_head * G + r % G (the G
query heads of one kv head share every K/V load). Decode (one query per sequence) fills G rows of a
tile; the dot shape stays the same.

Key splits (C keys, a multiple of 64, the same on both sides: the settings' key split, VEXACT_KEY_SPLIT,
2,048 when unset, 0 for none): a query at position p reduces its keys in chunks [jC, (j + 1)C),
j = 0 .. p // C, each chunk by the loop above from a fresh state (m = -inf, l = 0, acc = 0), then folds
the chunk states in order j = 1, 2, ... into chunk 0's (`fold_chunk`):
    M = max(m, m_j),  a = exp2(m - M),  b = exp2(m_j - M)
    l = fma(l, a, l_j * b),  acc = acc * a + acc_j * b,  m = M
and normalises as above. A row before key C keeps the unsplit bits (chunk 0 is the loop above). Every
entry point gives the same bits: training and paged steps fold the chunks in one program
(`attend_rows`); a thin paged step (`paged_triton.split_decode`) runs each chunk as its own
program, stores its state in fp32 and folds them with the same `fold_chunk`, row by row (a row of one
chunk is normalised and stored by its chunk's program, as the fold would). Within a chunk the
exponentials use 0 where the running max is still -inf (`attend_tile(SAFE=True)`: a row may meet a
chunk's first tile wholly masked in training tiles), which leaves a finite max's arithmetic as it
is. A split lets a step of few long rows use every SM, as FlashAttention's split-KV does, with its
boundaries anchored to key positions instead of chosen by the load. The shared-prompt groups and
FA4 refuse it.

Head sizes: the queries and keys have HEAD_DIM dims, the values HEAD_DIM_V (equal for most models;
DeepSeek's MLA: 192 and 128). Each is any multiple of 8 up to 256, held in a power-of-two tile
(BLOCK_D, BLOCK_DV = `head_block`: the next power of two, at least 16, which tl.dot needs); the dims
past the head size are loaded as 0 (so the q.k dot adds exact zeros) and never stored. Where a size is
a power of two (BLOCK_D == HEAD_DIM) the loads carry no such mask: the kernel of a model with equal
power-of-two head sizes is the one it always was.

The entry modules: `varlen_triton.py` (training, and its autograd; backward in
`varlen_triton_bwd.py`), `paged_triton.py` (the paged cache: prefill, chunked prefill,
decode, split decode), `prefix_triton.py` (the shared-prompt groups' prefix). Each imports
this module, never another entry module.
"""

import math

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

from ..dispatch import key_split
from .tiles import KEY_TILE

LOG2E = math.log2(math.e)

# BLOCK_D (the query/key head size's tile, `head_block`) -> (BLOCK_M rows, num_warps, num_stages) of
# every forward launch, varlen and paged alike. Keyed by the head size only: the dot shapes (and so
# the MMA instructions and their summation order) must never change with the batch, the entry point
# or the number of queries. DeepSeek's 192/128 heads take the 256 row (a speed choice only).
FWD_CONFIGS = {
    16: (64, 4, 2),
    32: (64, 4, 2),
    64: (64, 4, 3),
    128: (64, 4, 3),
    256: (64, 8, 2),
}


# Interpreter note: reductions are spelled `tl.reduce(x, 1, _sum_combine)` / `_elementwise_max` and
# constants `tl.full`: exactly what `tl.sum` / `tl.max` / `tl.zeros` expand to for fp32, without a call
# to a @triton.jit library function, which stays compiled-only when Triton was imported before
# TRITON_INTERPRET was set (the tests).


@triton.jit
def tile_dot(a, b, acc, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """tl.dot(a, b, acc). DOT_FP32, interpreter only: its tl.dot reads bf16 as raw bits and numpy's
    matmul gives a row different bits at different row indices; there each product row is summed
    over the contiguous last axis instead (exact fp32 products of bf16, one order per length)."""
    if DOT_FP32:
        out = tl.reduce(
            a.to(tl.float32)[:, None, :] * tl.trans(b.to(tl.float32))[None, :, :], 2, _sum_combine
        )
        if acc is not None:
            out = acc + out
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def load_tile(ptrs, rows_ok, cols, DIM: tl.constexpr, BLOCK: tl.constexpr, ROWS_MASKED: tl.constexpr):
    """tl.load of a [R, BLOCK] tile of rows whose last DIM columns are data (cols = arange(BLOCK)):
    rows where not rows_ok (read only if ROWS_MASKED) and columns past DIM read as 0. With
    BLOCK == DIM the load carries no column mask: the load of the equal power-of-two head sizes."""
    if BLOCK == DIM:
        if ROWS_MASKED:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        if ROWS_MASKED:
            x = tl.load(ptrs, mask=rows_ok[:, None] & (cols < DIM)[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=(cols < DIM)[None, :], other=0.0)
    return x


@triton.jit
def load_rope_tile(row_ptrs, rows_ok, HEAD_DIM: tl.constexpr, HEAD_DIM_R: tl.constexpr, BLOCK_R: tl.constexpr):
    """The latent's rotary query dims: [R, BLOCK_R] from each row's cells HEAD_DIM .. HEAD_DIM +
    HEAD_DIM_R (row_ptrs [R]: the rows' first cells); rows not ok and dims past HEAD_DIM_R read as 0."""
    offs_r = tl.arange(0, BLOCK_R)
    return load_tile(row_ptrs[:, None] + HEAD_DIM + offs_r[None, :], rows_ok, offs_r, HEAD_DIM_R, BLOCK_R, True)


@triton.jit
def store_tile(ptrs, x, rows_ok, cols, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """tl.store of a [R, BLOCK] tile's rows where rows_ok, columns below DIM only."""
    if BLOCK == DIM:
        tl.store(ptrs, x, mask=rows_ok[:, None])
    else:
        tl.store(ptrs, x, mask=rows_ok[:, None] & (cols < DIM)[None, :])


def head_block(head_dim: int) -> int:
    """The power-of-two tile width holding a head of `head_dim` dims (at least 16: tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def tile_count(n_tokens: int, n_seqs: int, tokens: int) -> int:
    """Programs along a launch's tile axis: start(B) of `tile_start`'s layout, from the shapes alone."""
    return min(n_tokens // tokens + n_seqs, n_tokens)


@triton.jit
def tile_start(start, b, TOKENS: tl.constexpr):
    """The first program of sequence b, whose tokens start at packed row `start`: the smaller of two
    layouts that each give every sequence at least ceil(q_len / TOKENS) programs, start // TOKENS + b
    (a step of +1 a sequence plus its whole tiles) and start (one program a token), so their minimum
    does too. A step of one-token decodes gets exactly one program a sequence."""
    return tl.minimum(start // TOKENS + b, start)


@triton.jit
def seq_of_tile(start_loc_ptr, n_seqs, tile, TOKENS: tl.constexpr, CHUNK: tl.constexpr = 128):
    """The sequence owning program `tile`.

    Sequence b owns programs start(b) .. start(b + 1) - 1 with start(b) = tile_start(start_loc[b], b),
    at least ceil(q_len_b / TOKENS) of them (extra ones exit), and start(B) = tile_count(T, B) bounds the
    grid by shapes alone. start never falls and start(0) = 0, so the owner is the number of b with
    start(b) <= tile, minus one (a sequence sharing its start with the next owns no program): counted
    over CHUNK sequences per (independent) vector load.
    """
    offs = tl.arange(0, CHUNK)
    count = tl.full([CHUNK], 0, dtype=tl.int32)
    for c in range(0, n_seqs, CHUNK):
        b = c + offs
        start = tile_start(tl.load(start_loc_ptr + b, mask=b < n_seqs, other=0), b, TOKENS)
        count += ((b < n_seqs) & (start <= tile)).to(tl.int32)
    return tl.reduce(count, 0, _sum_combine) - 1


@triton.jit
def query_rows(first, end, pos0, kv_head, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row r of a tile: token first + r // GROUP (absolute position pos0 + r // GROUP), query head
    kv_head * GROUP + r % GROUP. Rows past `end` (or past the last whole token) are invalid; they
    compute at position 0 and are never stored."""
    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    token = first + tok
    head = kv_head * GROUP + rows % GROUP
    valid = (tok < BLOCK_M // GROUP) & (token < end)
    q_pos = tl.where(valid, pos0 + tok, 0)
    return token.to(tl.int64), head, valid, q_pos


@triton.jit
def attend_tile(
    t,
    q,
    q_r,
    q_pos,
    m_i,
    l_i,
    acc,
    seq_len,
    k_base,
    v_base,
    kv_row0,
    stride_k_row,
    stride_v_row,
    block_table_row,
    stride_k_block,
    stride_v_block,
    qk_scale,
    MASKED: tl.constexpr,  # False only for tiles wholly at or below every row's position
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SAFE: tl.constexpr = False,  # key splits: a row may meet a chunk's first tile wholly masked
    HEAD_DIM_R: tl.constexpr = 0,  # the latent's rotary key dims after HEAD_DIM (0: keys and values apart)
    BLOCK_R: tl.constexpr = 16,  # HEAD_DIM_R's power-of-two tile
):
    """One step of the online softmax: key tile t (positions t * BLOCK_N ...) into (m_i, l_i, acc).

    The latent (HEAD_DIM_R > 0, DeepSeek's MLA): a key row holds HEAD_DIM latent dims then HEAD_DIM_R
    rotary dims, the values are its latent dims (HEAD_DIM_V = HEAD_DIM): one load serves both
    products, and the score is the latent dot chained with the rotary dot (q_r: the rows' rotary
    query dims) on one fp32 accumulator, in that order. Otherwise q_r is not read.

    MASKED = False skips the causal `where` and the load masks; it is used only where they would
    change nothing (every key of the tile is <= every row's position < seq_len), so an element's
    arithmetic, and its bits, are the same in both variants. SAFE (key splits) exponentiates
    against 0 where the running max is still -inf (a row that has met no key of its chunk yet), so
    the state stays (-inf, 0, 0) instead of NaN; where the max is finite it is the max itself, the
    same arithmetic as without SAFE.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # 1. K/V rows of tile t (positions past the sequence, and dims past the head sizes, read as 0).
    pos = t * BLOCK_N + offs_n
    in_seq = pos < seq_len
    if PAGED:
        if MASKED:
            block = tl.load(block_table_row + pos // PAGE, mask=in_seq, other=0)
        else:
            block = tl.load(block_table_row + pos // PAGE)
        block = block.to(tl.int64)
        slot = (pos % PAGE).to(tl.int64)
        k_rows = block * stride_k_block + slot * stride_k_row
        v_rows = block * stride_v_block + slot * stride_v_row
    else:
        row = (kv_row0 + pos).to(tl.int64)
        k_rows = row * stride_k_row
        v_rows = row * stride_v_row
    k_ptrs = k_base + k_rows[:, None] + offs_d[None, :]
    v_ptrs = v_base + v_rows[:, None] + offs_dv[None, :]
    k = load_tile(k_ptrs, in_seq, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    # 2. Scores, -inf past each row's position.
    s = tile_dot(q, tl.trans(k), None, PRECISION, DOT_FP32)  # [BLOCK_M, BLOCK_N] fp32
    if HEAD_DIM_R > 0:
        offs_r = tl.arange(0, BLOCK_R)
        r = load_tile(k_base + k_rows[:, None] + HEAD_DIM + offs_r[None, :], in_seq, offs_r, HEAD_DIM_R, BLOCK_R, MASKED)
        s = tile_dot(q_r, tl.trans(r), s, PRECISION, DOT_FP32)
        v = k
    else:
        v = load_tile(v_ptrs, in_seq, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)
    if MASKED:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    # 3. Online softmax update (a tile past a row's position leaves that row's m, l, acc as is).
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _elementwise_max) * qk_scale)
    m_use = m_new
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(tl.fma(s, qk_scale, -m_use[:, None]))
    if HEAD_DIM_R > 0:
        # The latent decodes in smaller row tiles than it trains (`latent_config`), so a row's sum must
        # not depend on the tile's layout: tl.reduce's tree follows it (a 16-row mma.sync tile and a
        # 64-row wgmma tile sum differently on the H200) while a dot is one K-order chain per element in
        # either. Summed: the rounded p that the values are weighted with; its 16 equal columns, one read.
        ones = tl.full([BLOCK_N, 16], 1.0, v.dtype)
        row_sum = tl.reduce(tile_dot(p.to(v.dtype), ones, None, PRECISION, DOT_FP32), 1, _elementwise_max)
    else:
        row_sum = tl.reduce(p, 1, _sum_combine)
    l_i = tl.fma(l_i, alpha, row_sum)
    acc = acc * alpha[:, None]
    acc = tile_dot(p.to(v.dtype), v, acc, PRECISION, DOT_FP32)
    return m_new, l_i, acc


@triton.jit
def attend_rows(
    q,
    q_r,
    q_pos,
    min_pos,
    max_pos,
    seq_len,
    k_base,
    v_base,
    kv_row0,
    stride_k_row,
    stride_v_row,
    block_table_row,
    stride_k_block,
    stride_v_block,
    qk_scale,
    PAGED: tl.constexpr,  # K/V rows from cache slots through the block table (else packed rows)
    PAGE: tl.constexpr,  # cache block size (slots per block); a power of two in practice
    HEAD_DIM: tl.constexpr,  # the query/key head size: the scores' reduction length
    HEAD_DIM_V: tl.constexpr,  # the value head size: the output's width
    BLOCK_D: tl.constexpr,  # HEAD_DIM's power-of-two tile (`head_block`): the dot's reduction length
    BLOCK_DV: tl.constexpr,  # HEAD_DIM_V's power-of-two tile
    BLOCK_M: tl.constexpr,  # rows of the tile: fixed per head size (sets the MMA shape)
    BLOCK_N: tl.constexpr,  # = KEY_TILE: sets which keys are summed together, anchored at 0
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), default otherwise
    DOT_FP32: tl.constexpr,  # interpreter only (see `tile_dot`)
    SPLIT_TILES: tl.constexpr = 0,  # key tiles per split (0: none; module docstring, "Key splits")
    HEAD_DIM_R: tl.constexpr = 0,  # the latent's rotary dims (`attend_tile`; 0: none, q_r unread)
    BLOCK_R: tl.constexpr = 16,
):
    """The per-tile attention shared by every entry point (module docstring: math and invariant).

    q: [BLOCK_M, BLOCK_D] (0 past HEAD_DIM); q_pos: [BLOCK_M] absolute positions, from min_pos to max_pos over the
    valid rows; keys at positions >= seq_len are never read. K/V row of position j: packed row
    kv_row0 + j, or cache slot (block_table_row[j // PAGE], j % PAGE). Tiles 0 .. max_pos // BLOCK_N
    in order: those wholly at or below min_pos without masks, the rest with them. Returns
    (out fp32 [BLOCK_M, BLOCK_DV], 0 past HEAD_DIM_V; lse [BLOCK_M] in log2 units).
    """
    last = max_pos // BLOCK_N + 1  # tiles 0 .. last - 1
    if SPLIT_TILES == 0:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_DV], 0, dtype=tl.float32)
        m_i, l_i, acc = attend_span(
            0, last, m_i, l_i, acc, q, q_r, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row,
            stride_v_row, block_table_row, stride_k_block, stride_v_block, qk_scale,
            PAGED, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PRECISION, DOT_FP32,
            HEAD_DIM_R=HEAD_DIM_R, BLOCK_R=BLOCK_R,
        )  # fmt: skip
    else:  # chunk 0, then each later chunk from a fresh state, folded in (module docstring)
        m_i, l_i, acc = attend_chunk(
            0, last, q, q_r, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
            block_table_row, stride_k_block, stride_v_block, qk_scale,
            SPLIT_TILES, PAGED, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32,
            HEAD_DIM_R, BLOCK_R,
        )  # fmt: skip
        for j in range(1, (last + SPLIT_TILES - 1) // SPLIT_TILES):
            m_j, l_j, acc_j = attend_chunk(
                j, last, q, q_r, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
                block_table_row, stride_k_block, stride_v_block, qk_scale,
                SPLIT_TILES, PAGED, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, PRECISION,
                DOT_FP32, HEAD_DIM_R, BLOCK_R,
            )  # fmt: skip
            m_i, l_i, acc = fold_chunk(m_i, l_i, acc, m_j, l_j, acc_j, q_pos >= j * SPLIT_TILES * BLOCK_N)
    # 4. Normalise.
    return acc / l_i[:, None], m_i + tl.log2(l_i)


@triton.jit
def attend_span(
    t_lo, t_hi, m_i, l_i, acc, q, q_r, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row,
    stride_v_row, block_table_row, stride_k_block, stride_v_block, qk_scale, PAGED: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    SAFE: tl.constexpr = False, HEAD_DIM_R: tl.constexpr = 0, BLOCK_R: tl.constexpr = 16,
):  # fmt: skip
    """Key tiles t_lo .. t_hi - 1 into the online softmax's state (m_i, l_i, acc), in order: those
    wholly at or below min_pos (the tiles' rows' least position) without masks, the rest with them.
    Returns the state unnormalised: `attend_rows` runs it from tile 0, `_resume_rows` from the tiles
    the shared-prefix kernel did, `attend_chunk` over one key split's tiles (SAFE)."""
    n_full = (min_pos + 1) // BLOCK_N
    for t in range(t_lo, tl.minimum(t_hi, n_full)):
        m_i, l_i, acc = attend_tile(
            t, q, q_r, q_pos, m_i, l_i, acc, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
            block_table_row, stride_k_block, stride_v_block, qk_scale,
            False, PAGED, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PRECISION, DOT_FP32, SAFE,
            HEAD_DIM_R, BLOCK_R,
        )  # fmt: skip
    for t in range(tl.maximum(t_lo, n_full), t_hi):
        m_i, l_i, acc = attend_tile(
            t, q, q_r, q_pos, m_i, l_i, acc, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
            block_table_row, stride_k_block, stride_v_block, qk_scale,
            True, PAGED, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PRECISION, DOT_FP32, SAFE,
            HEAD_DIM_R, BLOCK_R,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def attend_chunk(
    j, last, q, q_r, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
    block_table_row, stride_k_block, stride_v_block, qk_scale, SPLIT_TILES: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, HEAD_DIM_R: tl.constexpr = 0, BLOCK_R: tl.constexpr = 16,
):  # fmt: skip
    """Key split j's state (m, l, acc), unnormalised: its tiles (those below `last`) from a fresh
    state, SAFE. The one routine for a chunk, in one program (`attend_rows`) and in split decode
    (`_partial_rows`)."""
    m_j = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_j = tl.full([BLOCK_M], 0, dtype=tl.float32)
    acc_j = tl.full([BLOCK_M, BLOCK_DV], 0, dtype=tl.float32)
    return attend_span(
        j * SPLIT_TILES, tl.minimum((j + 1) * SPLIT_TILES, last), m_j, l_j, acc_j, q, q_r, q_pos, min_pos,
        seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row, block_table_row, stride_k_block,
        stride_v_block, qk_scale, PAGED, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PRECISION,
        DOT_FP32, True, HEAD_DIM_R, BLOCK_R,
    )  # fmt: skip


@triton.jit
def fold_chunk(m_i, l_i, acc, m_j, l_j, acc_j, reach):
    """The running state (m_i, l_i, acc) with a later chunk's (m_j, l_j, acc_j) folded in, on the rows
    where `reach` (the row's position is in or past the chunk); the other rows keep their state
    untouched. `_fold_kernel` folds a decode's partials with this same routine."""
    m_new = tl.maximum(m_i, m_j)
    a = tl.exp2(m_i - m_new)
    b = tl.exp2(m_j - m_new)
    l_new = tl.fma(l_i, a, l_j * b)
    acc_new = acc * a[:, None] + acc_j * b[:, None]
    return (
        tl.where(reach, m_new, m_i),
        tl.where(reach, l_new, l_i),
        tl.where(reach[:, None], acc_new, acc),
    )


def check_head_dims(head_dim: int, head_dim_v: int | None = None) -> None:
    """ValueError unless the Triton attention takes these head sizes: each a multiple of 8 up to 256."""
    for name, size in (("head_dim", head_dim), ("value head_dim", head_dim_v)):
        if size is not None and (size % 8 or not 8 <= size <= max(FWD_CONFIGS)):
            raise ValueError(
                f"Triton attention supports a {name} that is a multiple of 8 up to {max(FWD_CONFIGS)}, got "
                f"{size}; use the torch backend (dispatch.reference_mode) for other sizes"
            )


def forward_config(head_dim: int, group: int, head_dim_v: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) of every forward launch for these head sizes (`head_dim_v`:
    the value head size, None for head_dim), from the query/key tile's row of FWD_CONFIGS;
    ValueError if none."""
    check_head_dims(head_dim, head_dim_v)
    block_m, num_warps, num_stages = FWD_CONFIGS[head_block(head_dim)]
    if head_dim_v not in (None, head_dim) and head_dim % 16:
        # Triton 3.6's 4-warp build of these pairs (40/24, 56/8: an odd multiple of 8 with a different
        # value size) reads shared memory out of range on the H200; 8 warps run them.
        num_warps = max(num_warps, 8)
    if group > block_m:
        raise ValueError(f"Triton attention needs Hq / Hkv <= {block_m} for head_dim {head_dim}, got {group}")
    return block_m, num_warps, num_stages


# The latent (DeepSeek's MLA: one key head of C latent + R rotary dims, values its latent dims), every
# launch: (BLOCK_M rows, num_warps, num_stages). 8 warps hold the [64, C] fp32 accumulator. The rows of
# a tile are (token, query head) pairs as above; a rank with more query heads than rows takes its
# heads in blocks of `latent_group` (programs along the kv-head axis, reading the one key head). A
# decode launch (one query token a sequence) takes the smallest of LATENT_DECODE_ROWS that holds
# its heads (at most 64): a row's bits do not depend on its tile's rows (the row sum in
# `attend_tile`), and a 64-row tile would hold 16 heads and 48 idle rows. LATENT_DECODE_WARPS: its
# num_warps by rows (speed only: the dots' and the row sum's bits do not depend on the warps). On the
# H200 at 64 x 8k and 16 x 32k, 16 heads: 0.161 / 0.167 ms with 4 warps against 0.227 / 0.234 with 8 (FlashMLA
# 0.165 / 0.166); 32 heads: 0.229 / 0.235 against 0.301 / 0.308 (benchmarks/bench_mla.py --decode-warps 4,8).
LATENT_FWD_CONFIG = (64, 8, 2)
LATENT_DECODE_ROWS = (16, 32, 64)
LATENT_DECODE_WARPS = {16: 4, 32: 4, 64: 8}


def latent_group(heads: int, block_m: int) -> int:
    """Query heads a latent tile of `block_m` rows takes: the largest divisor of `heads` that fits."""
    return max(g for g in range(1, min(heads, block_m) + 1) if heads % g == 0)


def latent_config(
    latent_dim: int, rope_dim: int, heads: int, decode: bool = False, fp32: bool = False
) -> tuple[int, int, int, int]:
    """(group, BLOCK_M, num_warps, num_stages) of the latent's launches: `group` query heads a tile
    (the largest divisor of `heads` that fits BLOCK_M rows); `decode`: a launch of one query token a
    sequence; `fp32`: float32 inputs (one stage: twice the bytes a tile). ValueError for sizes it does
    not take."""
    if latent_dim % 8 or rope_dim % 8 or not 0 < rope_dim <= 256 or not 8 <= latent_dim <= 512:
        raise ValueError(
            f"Triton latent attention takes a latent of 8-512 dims and rotary dims of 8-256 (multiples of 8), "
            f"got {latent_dim} and {rope_dim}; use the torch backend (dispatch.reference_mode) for other sizes"
        )
    block_m, num_warps, num_stages = LATENT_FWD_CONFIG
    if fp32:
        # sm_90a, Triton 3.6: 164 KiB of shared memory at 256 + 64 dims, one stage; 304 KiB at 512 + 64
        # with two stages (an H200 SM has 227), and past the limit at one stage too.
        num_stages = 1
        if latent_dim > 256 and not interpreted():
            raise ValueError(
                f"float32 latent attention on the GPU takes at most 256 latent dims, got {latent_dim} (its tiles "
                "exceed an SM's shared memory): run the model in bfloat16 (verl's FSDP runs it under bf16 "
                "autocast), or use the torch backend (dispatch.reference_mode)"
            )
    if decode:
        block_m = min(rows for rows in LATENT_DECODE_ROWS if rows >= min(heads, block_m))
        num_warps = LATENT_DECODE_WARPS[block_m]
    return latent_group(heads, block_m), block_m, num_warps, num_stages


def interpreted() -> bool:
    return type(attend_rows).__name__ == "InterpretedFunction"


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def key_split_tiles(reach: int) -> int:
    """SPLIT_TILES of a launch whose rows reach at most `reach` keys: VEXACT_KEY_SPLIT's, or 0 where
    no row reaches key C. A row before key C has the same bits either way (module docstring), and the
    kernel without the fold runs with one accumulator instead of two: on an H100 the fold's kernel
    took 1.15 ms for 8 x 1,024 tokens' forward+backward against 0.93 without it, and rollouts where
    no row reaches C run within the spread of the unsplit kernel with this rule (6-12% slower
    without it; see docs/results.md#key-split)."""
    keys = key_split()
    return keys // KEY_TILE if keys and reach > keys else 0
