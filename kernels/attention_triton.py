"""Triton (CUDA) causal attention with one position-anchored reduction order for training and inference.

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

Invariant: every query runs this loop in ONE @triton.jit routine, `_attend_rows`, called by both entry
kernels (`_varlen_fwd_kernel` for training, `_paged_fwd_kernel` for prefill, chunked prefill and
decode) with the same BLOCK_M x BLOCK_N x HEAD_DIM dot shapes, num_warps and num_stages (one config per
head_dim, `_FWD_CONFIGS`), so the MMA shape never depends on the batch. The entry kernels differ only
in where the K/V rows come from (packed rows vs block_table-resolved cache slots) and in which
(token, head) pairs fill the BLOCK_M rows; rows of a dot are independent, so neither changes a row's
bits. No split-KV unless asked for (below): tiles 0..p // 64 are reduced in order by one program. A tile that lies entirely
past a row's position (a neighbouring row in the same tile reaches further) is a bitwise no-op for
that row: its scores are all -inf, so m' = m, alpha = exp2(0) = 1, e = 0 (and the K/V rows past the
sequence are loaded as 0, so 0 * v = 0: no NaN from unused cache slots). Hence out(p, h) depends only
on q[p, h] and K/V at positions 0..p: not on the batch, the chunking, the block size or the block
table. Tiles wholly at or below every row's position skip the (then inert) masks; an element's
arithmetic is the same with or without them. The fused multiply-adds are explicit (`tl.fma`) and
the launches disable FP contraction, so no compiler choice can differ between the entry kernels.

Rows of a program's tile: row r holds token first + r // G, query head kv_head * G + r % G (the G
query heads of one kv head share every K/V load). Decode (one query per sequence) fills G rows of a
tile; the dot shape stays the same.

Key splits (VEXACT_KEY_SPLIT = C keys, a multiple of 64, the same on both sides; 2,048 when unset,
0 for none; `dispatch.key_split`): a query at position p reduces its keys in chunks [jC, (j + 1)C), j = 0 ..
p // C, each chunk by the loop above from a fresh state (m = -inf, l = 0, acc = 0), then folds the
chunk states in order j = 1, 2, ... into chunk 0's (`_fold`):
    M = max(m, m_j),  a = exp2(m - M),  b = exp2(m_j - M)
    l = fma(l, a, l_j * b),  acc = acc * a + acc_j * b,  m = M
and normalises as above. A row before key C keeps the unsplit bits (chunk 0 is the loop above). Every
entry point gives the same bits: training and paged steps fold the chunks in one program
(`_attend_rows`), a thin paged step (`split_decode`) runs each chunk as its own program, stores its
state in fp32 and `_fold_kernel` folds them with the same `_fold`, row by row (a row of one chunk is
normalised and stored by its chunk's program, as the fold would). Within a chunk the
exponentials use 0 where the running max is still -inf (`_attend_tile(SAFE=True)`: a row may meet
a chunk's first tile wholly masked in training tiles), which leaves a finite max's arithmetic as it
is. A split lets a step of few long rows use every SM, as FlashAttention's split-KV does, with its
boundaries anchored to key positions instead of chosen by the load. The shared-prompt groups and
FA4 refuse it.

The varlen path is differentiable (`_VarlenAttention`, backward in `attention_triton_bwd`:
deterministic, no atomics). The paged path is CUDA-graph safe: its grid depends on T and B only and
every program reads the sequence metadata on the device (programs without work exit at once).
"""

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

from .attention import KEY_TILE
from .autograd_utils import backward_without_autocast
from .dispatch import key_split

_LOG2E = math.log2(math.e)

# head_dim -> (BLOCK_M rows, num_warps, num_stages) of every forward launch, varlen and paged alike.
# Keyed by head_dim only: the dot shapes (and so the MMA instructions and their summation order)
# must never change with the batch, the entry point or the number of queries.
_FWD_CONFIGS = {
    16: (64, 4, 2),
    32: (64, 4, 2),
    64: (64, 4, 3),
    128: (64, 4, 3),
    256: (64, 8, 2),
}


# head_dim -> num_stages of the paged (inference) launches where it differs from _FWD_CONFIGS': speed
# only (how many K/V tiles a program has in flight), never a bit. With Triton 3.6 on sm_90a, 3 stages
# give two K/V buffers (81 KB of shared memory), 5 give three (113 KB, still two programs per SM), 7
# four (145 KB, one program per SM: for steps with fewer programs than SMs):
# benchmarks/bench_kernels.py --paged-stages times them.
_PAGED_STAGES: dict[int, int] = {}

# head_dim -> num_stages of the launches with shared-prompt groups (`paged_attention(shared=...)`:
# the prefix kernel and the paged kernel resuming after it), where they differ from the above: speed
# only. bench_kernels.py's rollout section (session 21, H100) put grpo-shaped steps at 1.06 of FA3
# with 5 stages against 1.00 with 3, and 0.99 / 0.96 against 0.94 / 0.90 where groups share little.
_SHARED_STAGES: dict[int, int] = {128: 5}


# head_dim -> ((programs per SM at most, num_stages), ...): the paged launches of thin steps, whose
# grid leaves the GPU room (at 3 stages two programs fit an SM), keep more K/V tiles in flight per
# program: speed only. Session 20's microbench (H100, decode at 16 x 32k keys: 128 programs) put them
# at 0.81 of FA3 with 3 stages, 0.97 with 5 and 1.00 with 7; at 32 x 6k (256 programs) 0.99 / 1.00 /
# 0.99. The grid follows the step's shapes, so a CUDA graph captured per batch size keeps its depth.
# Hopper only, like _SHARED_STAGES (measured there; 7 stages need 148 KB of shared memory a program
# and 5 stages 113 KB, more than an sm_89 GPU has).
_THIN_STAGES: dict[int, tuple[tuple[int, int], ...]] = {128: ((1, 7), (2, 5))}
_THIN_CAPABILITIES = ((9, 0),)
# head_dim -> num_stages of split decode's chunk launch (a key split; Hopper only, as above): at
# C = 2,048, 5 stages against 3 / 7 ran an 8B uneven step in 73.8 / 77.1 / 87.1 us on the H200 and 16 x
# 5,200 keys in 132.3 / 137.3 / 137.5 us on the H100 (see docs/results.md).
_SPLIT_STAGES: dict[int, int] = {128: 5}


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _thin_sms(device_index: int) -> int | None:
    """The SM count where paged_stages' measured depths apply (_THIN_CAPABILITIES), else None."""
    capability = torch.cuda.get_device_capability(device_index)
    return _sm_count(device_index) if capability in _THIN_CAPABILITIES else None


def paged_stages(
    head_dim: int, programs: int, sms: int | None, shared: bool, default: int, split: bool = False
) -> int:
    """num_stages of a paged launch of `programs` programs on a GPU of `sms` SMs (None: unknown, as in
    the interpreter, or a GPU these depths were not measured on: then the forward's): _PAGED_STAGES
    (empty: a benchmark may fill it), else split decode's (`split`, _SPLIT_STAGES), else the thin-step depth
    (_THIN_STAGES), else the shared-prompt launches' (_SHARED_STAGES), else the forward's `default`.
    Which depth runs changes no bit (tests: test_paged_pipelining_depth_changes_no_bit_cuda)."""
    if head_dim in _PAGED_STAGES:
        return _PAGED_STAGES[head_dim]
    if not sms:  # the depths below were measured on Hopper only (see _THIN_CAPABILITIES)
        return default
    if split:
        return _SPLIT_STAGES.get(head_dim, default)
    for per_sm, stages in _THIN_STAGES.get(head_dim, ()):
        if programs <= per_sm * sms:
            return stages
    if shared:
        return _SHARED_STAGES.get(head_dim, default)
    return default


# Interpreter note: reductions are spelled `tl.reduce(x, 1, _sum_combine)` / `_elementwise_max` and
# constants `tl.full`: exactly what `tl.sum` / `tl.max` / `tl.zeros` expand to for fp32, without a call
# to a @triton.jit library function, which stays compiled-only when Triton was imported before
# TRITON_INTERPRET was set (the tests).


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
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


def tile_count(n_tokens: int, n_seqs: int, tokens: int) -> int:
    """Programs along a launch's tile axis: start(B) of `_tile_start`'s layout, from the shapes alone."""
    return min(n_tokens // tokens + n_seqs, n_tokens)


@triton.jit
def _tile_start(start, b, TOKENS: tl.constexpr):
    """The first program of sequence b, whose tokens start at packed row `start`: the smaller of two
    layouts that each give every sequence at least ceil(q_len / TOKENS) programs, start // TOKENS + b
    (a step of +1 a sequence plus its whole tiles) and start (one program a token), so their minimum
    does too. A step of one-token decodes gets exactly one program a sequence."""
    return tl.minimum(start // TOKENS + b, start)


@triton.jit
def _seq_of_tile(start_loc_ptr, n_seqs, tile, TOKENS: tl.constexpr, CHUNK: tl.constexpr = 128):
    """The sequence owning program `tile`.

    Sequence b owns programs start(b) .. start(b + 1) - 1 with start(b) = _tile_start(start_loc[b], b),
    at least ceil(q_len_b / TOKENS) of them (extra ones exit), and start(B) = tile_count(T, B) bounds the
    grid by shapes alone. start never falls and start(0) = 0, so the owner is the number of b with
    start(b) <= tile, minus one (a sequence sharing its start with the next owns no program): counted
    over CHUNK sequences per (independent) vector load.
    """
    offs = tl.arange(0, CHUNK)
    count = tl.full([CHUNK], 0, dtype=tl.int32)
    for c in range(0, n_seqs, CHUNK):
        b = c + offs
        start = _tile_start(tl.load(start_loc_ptr + b, mask=b < n_seqs, other=0), b, TOKENS)
        count += ((b < n_seqs) & (start <= tile)).to(tl.int32)
    return tl.reduce(count, 0, _sum_combine) - 1


@triton.jit
def _query_rows(first, end, pos0, kv_head, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
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
def _attend_tile(
    t,
    q,
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
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SAFE: tl.constexpr = False,  # key splits: a row may meet a chunk's first tile wholly masked
):
    """One step of the online softmax: key tile t (positions t * BLOCK_N ...) into (m_i, l_i, acc).

    MASKED = False skips the causal `where` and the load masks; it is used only where they would
    change nothing (every key of the tile is <= every row's position < seq_len), so an element's
    arithmetic, and its bits, are the same in both variants. SAFE (key splits) exponentiates
    against 0 where the running max is still -inf (a row that has met no key of its chunk yet), so
    the state stays (-inf, 0, 0) instead of NaN; where the max is finite it is the max itself, the
    same arithmetic as without SAFE.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # 1. K/V rows of tile t (positions past the sequence read as 0).
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
    v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    # 2. Scores, -inf past each row's position.
    s = _dot(q, tl.trans(k), None, PRECISION, DOT_FP32)  # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    # 3. Online softmax update (a tile past a row's position leaves that row's m, l, acc as is).
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _elementwise_max) * qk_scale)
    m_use = m_new
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(tl.fma(s, qk_scale, -m_use[:, None]))
    l_i = tl.fma(l_i, alpha, tl.reduce(p, 1, _sum_combine))
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc, PRECISION, DOT_FP32)
    return m_new, l_i, acc


@triton.jit
def _attend_rows(
    q,
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
    HEAD_DIM: tl.constexpr,  # the dot's reduction length for the scores
    BLOCK_M: tl.constexpr,  # rows of the tile: fixed per head_dim (sets the MMA shape)
    BLOCK_N: tl.constexpr,  # = KEY_TILE: sets which keys are summed together, anchored at 0
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), default otherwise
    DOT_FP32: tl.constexpr,  # interpreter only (see `_dot`)
    SPLIT_TILES: tl.constexpr = 0,  # key tiles per split (0: none; module docstring, "Key splits")
):
    """The per-tile attention shared by every entry point (module docstring: math and invariant).

    q: [BLOCK_M, HEAD_DIM]; q_pos: [BLOCK_M] absolute positions, from min_pos to max_pos over the
    valid rows; keys at positions >= seq_len are never read. K/V row of position j: packed row
    kv_row0 + j, or cache slot (block_table_row[j // PAGE], j % PAGE). Tiles 0 .. max_pos // BLOCK_N
    in order: those wholly at or below min_pos without masks, the rest with them. Returns
    (out fp32 [BLOCK_M, HEAD_DIM], lse [BLOCK_M] in log2 units).
    """
    last = max_pos // BLOCK_N + 1  # tiles 0 .. last - 1
    if SPLIT_TILES == 0:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, HEAD_DIM], 0, dtype=tl.float32)
        m_i, l_i, acc = _attend_span(
            0, last, m_i, l_i, acc, q, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row,
            stride_v_row, block_table_row, stride_k_block, stride_v_block, qk_scale,
            PAGED, PAGE, HEAD_DIM, BLOCK_N, PRECISION, DOT_FP32,
        )  # fmt: skip
    else:  # chunk 0, then each later chunk from a fresh state, folded in (module docstring)
        m_i, l_i, acc = _attend_chunk(
            0, last, q, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
            block_table_row, stride_k_block, stride_v_block, qk_scale,
            SPLIT_TILES, PAGED, PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32,
        )  # fmt: skip
        for j in range(1, (last + SPLIT_TILES - 1) // SPLIT_TILES):
            m_j, l_j, acc_j = _attend_chunk(
                j, last, q, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
                block_table_row, stride_k_block, stride_v_block, qk_scale,
                SPLIT_TILES, PAGED, PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32,
            )  # fmt: skip
            m_i, l_i, acc = _fold(m_i, l_i, acc, m_j, l_j, acc_j, q_pos >= j * SPLIT_TILES * BLOCK_N)
    # 4. Normalise.
    return acc / l_i[:, None], m_i + tl.log2(l_i)


@triton.jit
def _attend_span(
    t_lo, t_hi, m_i, l_i, acc, q, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
    block_table_row, stride_k_block, stride_v_block, qk_scale, PAGED: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    SAFE: tl.constexpr = False,
):  # fmt: skip
    """Key tiles t_lo .. t_hi - 1 into the online softmax's state (m_i, l_i, acc), in order: those
    wholly at or below min_pos (the tiles' rows' least position) without masks, the rest with them.
    Returns the state unnormalised: `_attend_rows` runs it from tile 0, `_resume_rows` from the tiles
    the shared-prefix kernel did, `_attend_chunk` over one key split's tiles (SAFE)."""
    n_full = (min_pos + 1) // BLOCK_N
    for t in range(t_lo, tl.minimum(t_hi, n_full)):
        m_i, l_i, acc = _attend_tile(
            t, q, q_pos, m_i, l_i, acc, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
            block_table_row, stride_k_block, stride_v_block, qk_scale,
            False, PAGED, PAGE, HEAD_DIM, BLOCK_N, PRECISION, DOT_FP32, SAFE,
        )  # fmt: skip
    for t in range(tl.maximum(t_lo, n_full), t_hi):
        m_i, l_i, acc = _attend_tile(
            t, q, q_pos, m_i, l_i, acc, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row,
            block_table_row, stride_k_block, stride_v_block, qk_scale,
            True, PAGED, PAGE, HEAD_DIM, BLOCK_N, PRECISION, DOT_FP32, SAFE,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attend_chunk(
    j, last, q, q_pos, min_pos, seq_len, k_base, v_base, kv_row0, stride_k_row, stride_v_row, block_table_row,
    stride_k_block, stride_v_block, qk_scale, SPLIT_TILES: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Key split j's state (m, l, acc), unnormalised: its tiles (those below `last`) from a fresh
    state, SAFE. The one routine for a chunk, in one program (`_attend_rows`) and in split decode
    (`_partial_rows`)."""
    m_j = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_j = tl.full([BLOCK_M], 0, dtype=tl.float32)
    acc_j = tl.full([BLOCK_M, HEAD_DIM], 0, dtype=tl.float32)
    return _attend_span(
        j * SPLIT_TILES, tl.minimum((j + 1) * SPLIT_TILES, last), m_j, l_j, acc_j, q, q_pos, min_pos, seq_len,
        k_base, v_base, kv_row0, stride_k_row, stride_v_row, block_table_row, stride_k_block, stride_v_block,
        qk_scale, PAGED, PAGE, HEAD_DIM, BLOCK_N, PRECISION, DOT_FP32, True,
    )  # fmt: skip


@triton.jit
def _fold(m_i, l_i, acc, m_j, l_j, acc_j, reach):
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


@triton.jit(do_not_specialize=["n_seqs"])  # the batch size must not select another kernel
def _varlen_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    cu_ptr,
    n_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    GROUP: tl.constexpr,  # Hq // Hkv: query heads packed along the rows of one kv head's tile
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    STORE_LSE: tl.constexpr,  # training keeps the log-sum-exp for the backward
    SPLIT_TILES: tl.constexpr = 0,  # key tiles per split (0: none)
):
    """Training entry: packed sequences (cu_seqlens); program (tile, kv head) -> BLOCK_M rows."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # late (long) tiles first
    kv_head = tl.program_id(1)
    b = _seq_of_tile(cu_ptr, n_seqs, tile, TOKENS)
    seq_start = tl.load(cu_ptr + b)
    seq_end = tl.load(cu_ptr + b + 1)
    first = seq_start + (tile - _tile_start(seq_start, b, TOKENS)) * TOKENS
    if first >= seq_end:
        return
    token, head, valid, q_pos = _query_rows(first, seq_end, first - seq_start, kv_head, GROUP, BLOCK_M)
    max_pos = first - seq_start + tl.minimum(seq_end - first, TOKENS) - 1
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    out, lse = _attend_rows(
        q,
        q_pos,
        first - seq_start,
        max_pos,
        seq_end - seq_start,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_vh,
        seq_start,
        stride_kt,
        stride_vt,
        cu_ptr,  # no block table
        0,
        0,
        qk_scale,
        False,
        1,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        PRECISION,
        DOT_FP32,
        SPLIT_TILES,
    )
    o_ptrs = o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    if STORE_LSE:
        tl.store(lse_ptr + token * stride_lt + head, lse, mask=valid)


@triton.jit(do_not_specialize=["n_seqs"])  # the batch size must not select another kernel
def _paged_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    block_table_ptr,
    seq_lens_ptr,
    start_loc_ptr,
    n_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SHARED: tl.constexpr = False,  # resume sequences whose first key tiles the shared-prefix kernel did
    resume_ptr=None,  # SHARED: int32 [B], key tiles already attended per sequence (0: none)
    ws_acc_ptr=None,  # SHARED: fp32 [B, Hq, HEAD_DIM], their unnormalised accumulators (by sequence)
    ws_ml_ptr=None,  # SHARED: fp32 [B, Hq, 2], their running max and sum
    stride_wt=0,  # SHARED: ws_acc's sequence stride (Hq * HEAD_DIM)
    stride_mt=0,  # SHARED: ws_ml's sequence stride (Hq * 2)
    SPLIT_TILES: tl.constexpr = 0,  # key tiles per split (0: none)
    PARTIAL: tl.constexpr = False,  # split decode: program (tile, kv head, chunk) -> that chunk's state
    part_acc_ptr=None,  # PARTIAL: fp32 [T, Hq, chunks, HEAD_DIM], each chunk's unnormalised accumulator
    part_ml_ptr=None,  # PARTIAL: fp32 [T, Hq, chunks, 2], its max and sum
    part_n_ptr=None,  # PARTIAL: int32 [T], chunks of each token's row (written for every sequence's token)
    stride_pt=0,  # PARTIAL: entries a token (Hq * chunks): entry (t, h, j) = t * stride_pt + h * chunks + j
    CHUNKS: tl.constexpr = 1,  # PARTIAL: the chunk axis of the workspaces
):
    """Inference entry: the new queries of each sequence (its last q_len positions) over the paged
    cache; program (tile, kv head) -> BLOCK_M rows, as in training. The programs take the tiles last
    first (a batch's later, longer sequences start first)."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    b = _seq_of_tile(start_loc_ptr, n_seqs, tile, TOKENS)
    local = tile - _tile_start(tl.load(start_loc_ptr + b), b, TOKENS)
    q_start = tl.load(start_loc_ptr + b)
    q_end = tl.load(start_loc_ptr + b + 1)
    first = q_start + local * TOKENS
    if first >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    pos0 = seq_len - q_end + first  # absolute position of token `first`
    token, head, valid, q_pos = _query_rows(first, q_end, pos0, kv_head, GROUP, BLOCK_M)
    max_pos = pos0 + tl.minimum(q_end - first, TOKENS) - 1
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    if PARTIAL:
        _partial_rows(
            q, q_pos, pos0, max_pos, seq_len, token, head, valid, k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh, stride_ks, stride_vs, block_table_ptr + b.to(tl.int64) * stride_bt,
            stride_kb, stride_vb, qk_scale, o_ptr, stride_ot, stride_oh, part_acc_ptr, part_ml_ptr, part_n_ptr,
            stride_pt, SPLIT_TILES, CHUNKS, PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32,
        )  # fmt: skip
        return
    if SHARED:
        out = _resume_rows(
            q, q_pos, pos0, max_pos, seq_len, head, valid, b, resume_ptr, ws_acc_ptr, ws_ml_ptr,
            stride_wt, stride_mt, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, stride_ks, stride_vs,
            block_table_ptr + b.to(tl.int64) * stride_bt, stride_kb, stride_vb, qk_scale,
            PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32,
        )  # fmt: skip
    else:
        out = _attend_paged(
            q, q_pos, pos0, max_pos, seq_len, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
            stride_ks, stride_vs, block_table_ptr + b.to(tl.int64) * stride_bt, stride_kb, stride_vb, qk_scale,
            PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32, SPLIT_TILES,
        )  # fmt: skip
    o_ptrs = o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _attend_paged(
    q, q_pos, pos0, max_pos, seq_len, k_base, v_base, stride_ks, stride_vs, block_table_row, stride_kb,
    stride_vb, qk_scale, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT_TILES: tl.constexpr = 0,
):  # fmt: skip
    """A paged tile's rows from key tile 0: `_attend_rows` normalised."""
    out, _ = _attend_rows(
        q,
        q_pos,
        pos0,
        max_pos,
        seq_len,
        k_base,
        v_base,
        0,
        stride_ks,
        stride_vs,
        block_table_row,
        stride_kb,
        stride_vb,
        qk_scale,
        True,
        PAGE,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        PRECISION,
        DOT_FP32,
        SPLIT_TILES,
    )
    return out


@triton.jit
def _partial_rows(
    q, q_pos, pos0, max_pos, seq_len, token, head, valid, k_base, v_base, stride_ks, stride_vs, block_table_row,
    stride_kb, stride_vb, qk_scale, o_ptr, stride_ot, stride_oh, part_acc_ptr, part_ml_ptr, part_n_ptr, stride_pt,
    SPLIT_TILES: tl.constexpr, CHUNKS: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Split decode: this program's chunk (program_id 2) of its rows' keys, from a fresh state, as
    `_attend_rows` computes each chunk, stored unnormalised for `_fold_kernel` (rows whose position
    the chunk does not reach store nothing). Chunk 0's programs store each row's chunk count, and
    the output of rows with one chunk (normalised as `_attend_rows` and `_fold_kernel` do), which
    the fold kernel then skips."""
    j = tl.program_id(2)
    last = max_pos // BLOCK_N + 1
    if j * SPLIT_TILES >= last:
        return
    m_j, l_j, acc_j = _attend_chunk(
        j, last, q, q_pos, pos0, seq_len, k_base, v_base, 0, stride_ks, stride_vs, block_table_row, stride_kb,
        stride_vb, qk_scale, SPLIT_TILES, True, PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32,
    )  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    n = q_pos // (SPLIT_TILES * BLOCK_N) + 1  # the row's chunks
    if j == 0:  # each of the token's G rows stores the same count
        tl.store(part_n_ptr + token, n, mask=valid)
        alone = valid & (n == 1)
        o_ptrs = o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, (acc_j / l_j[:, None]).to(o_ptr.dtype.element_ty), mask=alone[:, None])
    stored = valid & (n > 1) & (q_pos >= j * SPLIT_TILES * BLOCK_N)
    part = token.to(tl.int64) * stride_pt + (head * CHUNKS + j).to(tl.int64)  # the (token, head, chunk) entry
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc_j, mask=stored[:, None])
    tl.store(part_ml_ptr + part * 2, m_j, mask=stored)
    tl.store(part_ml_ptr + part * 2 + 1, l_j, mask=stored)


@triton.jit(do_not_specialize=["n_seqs"])  # the batch size must not select another kernel
def _fold_kernel(
    part_acc_ptr, part_ml_ptr, part_n_ptr, o_ptr, start_loc_ptr, n_seqs, stride_pt, stride_ot, stride_oh, n_heads,
    CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    """Split decode's second launch: program (token, head block) folds each of its HEADS heads' chunk
    states 0, 1, ... in order with `_fold` (the routine `_attend_rows` folds with; a head is a row of
    the [HEADS, HEAD_DIM] tile: element-wise, so the block size changes no bit) and normalises.
    Tokens past the sequences' (padding: their chunk count is unwritten) and rows of one chunk
    (already stored by `_partial_rows`) exit at once."""
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(start_loc_ptr + n_seqs):
        return
    n = tl.load(part_n_ptr + token)
    if n == 1:
        return
    offs_d = tl.arange(0, HEAD_DIM)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    real = heads < n_heads
    part = token * stride_pt + (heads * CHUNKS).to(tl.int64)  # chunk 0's (token, head, chunk) entries
    m_i = tl.load(part_ml_ptr + part * 2, mask=real, other=0.0)
    l_i = tl.load(part_ml_ptr + part * 2 + 1, mask=real, other=1.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=real[:, None], other=0.0)
    for j in range(1, n):
        m_j = tl.load(part_ml_ptr + (part + j) * 2, mask=real, other=0.0)
        l_j = tl.load(part_ml_ptr + (part + j) * 2 + 1, mask=real, other=1.0)
        acc_j = tl.load(part_acc_ptr + (part + j)[:, None] * HEAD_DIM + offs_d[None, :], mask=real[:, None], other=0.0)
        m_i, l_i, acc = _fold(m_i, l_i, acc, m_j, l_j, acc_j, real)
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=real[:, None])


@triton.jit
def _resume_rows(
    q, q_pos, pos0, max_pos, seq_len, head, valid, b, resume_ptr, ws_acc_ptr, ws_ml_ptr,
    stride_wt, stride_mt, k_base, v_base, stride_ks, stride_vs, block_table_row, stride_kb, stride_vb, qk_scale,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """A paged tile's rows, resumed after the key tiles the shared-prefix kernel attended for its
    sequence (attention_prefix_triton.py; none: from tile 0). Its state was stored in fp32 and is
    read back unchanged, so each row's arithmetic is the same as without the split."""
    t0 = tl.load(resume_ptr + b)
    resumed = valid.to(tl.int32) * t0 > 0  # rows of a sequence its group began
    offs_d = tl.arange(0, HEAD_DIM)
    seq = b.to(tl.int64)  # resumed rows are a decode's: one query, workspace row b
    ml = ws_ml_ptr + seq * stride_mt + head * 2
    m_i = tl.load(ml, mask=resumed, other=float("-inf"))
    l_i = tl.load(ml + 1, mask=resumed, other=0.0)
    acc_ptrs = ws_acc_ptr + seq * stride_wt + head[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=resumed[:, None], other=0.0)
    m_i, l_i, acc = _attend_span(
        t0, max_pos // BLOCK_N + 1, m_i, l_i, acc, q, q_pos, pos0, seq_len, k_base, v_base, 0, stride_ks,
        stride_vs, block_table_row, stride_kb, stride_vb, qk_scale, True, PAGE, HEAD_DIM, BLOCK_N, PRECISION,
        DOT_FP32,
    )  # fmt: skip
    return acc / l_i[:, None]


@triton.jit(do_not_specialize=["n_tokens"])  # the batch size must not select another kernel
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    n_tokens,
    n_slots,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_T: tl.constexpr,  # tokens per program (a copy: any value gives the same cache)
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COLS: tl.constexpr,  # next power of two of N_KV * HEAD_DIM_P (tl.arange)
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    """Copy token t's k, v rows [N_KV, HEAD_DIM] to cache slot slot_mapping[t]; slots < 0 (padding)
    and slots past the cache are skipped (no host-side check: CUDA-graph safe)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    col = tl.arange(0, COLS)
    h = col // HEAD_DIM_P
    d = col % HEAD_DIM_P
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < n_slots)
    mask = ok[:, None] & ((h < N_KV) & (d < HEAD_DIM))[None, :]  # [BLOCK_T, COLS]
    slot = tl.where(ok, slot, 0)
    block = slot // block_size
    offset = slot % block_size
    t = t.to(tl.int64)
    k = tl.load(k_ptr + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    k_rows = (block * stride_kcb + offset * stride_kcs)[:, None]
    v_rows = (block * stride_vcb + offset * stride_vcs)[:, None]
    tl.store(k_cache_ptr + k_rows + (h * stride_kch + d)[None, :], k, mask=mask)
    tl.store(v_cache_ptr + v_rows + (h * stride_vch + d)[None, :], v, mask=mask)


def forward_config(head_dim: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) of every forward launch for this head_dim; ValueError if none."""
    if head_dim not in _FWD_CONFIGS:
        raise ValueError(
            f"Triton attention supports head_dim in {sorted(_FWD_CONFIGS)}, got {head_dim}; "
            "use the torch backend (dispatch.reference_mode) for other sizes"
        )
    block_m, num_warps, num_stages = _FWD_CONFIGS[head_dim]
    if group > block_m:
        raise ValueError(f"Triton attention needs Hq / Hkv <= {block_m} for head_dim {head_dim}, got {group}")
    return block_m, num_warps, num_stages


def _interpreted() -> bool:
    return type(_attend_rows).__name__ == "InterpretedFunction"


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _varlen_forward(q, k, v, cu_seqlens, scale, store_lse, split_tiles):
    """out [T, Hq, D] (q.dtype) and, if store_lse, lse [T, Hq] fp32 in log2 units; `split_tiles`:
    `_split_tiles`'."""
    n_tokens, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    block_m, num_warps, num_stages = forward_config(head_dim, group)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((n_tokens, n_heads) if store_lse else (1, 1), dtype=torch.float32, device=q.device)
    n_seqs = cu_seqlens.shape[0] - 1
    if n_tokens == 0:
        return out, lse
    cu = cu_seqlens.to(torch.int32)
    grid = (tile_count(n_tokens, n_seqs, block_m // group), n_kv)
    _varlen_fwd_kernel[grid](
        q, k, v, out, lse, cu, n_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        PRECISION=_precision(q.dtype), DOT_FP32=_interpreted(), STORE_LSE=store_lse, enable_fp_fusion=False,
        num_warps=num_warps, num_stages=num_stages, SPLIT_TILES=split_tiles,
    )  # fmt: skip
    return out, lse


# The backward and shared-prefix kernels reuse the helpers above; imported here, after them, to
# break the cycle.
from . import attention_prefix_triton  # noqa: E402 (the module: either may be imported first)
from .attention_triton_bwd import varlen_attention_backward  # noqa: E402


class _VarlenAttention(torch.autograd.Function):
    """varlen attention with the FlashAttention-2 style recomputing backward (deterministic)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, split_tiles):
        out, lse = _varlen_forward(q, k, v, cu_seqlens, scale, True, split_tiles)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens.to(torch.int32))
        ctx.scale = scale
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.scale)
        return dq, dk, dv, None, None, None


def varlen_attention(q, k, v, cu_seqlens, scale, longest=None):
    """Triton implementation of `attention.varlen_attention` (inputs already checked there);
    `longest`: the longest sequence, if the caller has it (`_split_tiles`)."""
    forward_config(q.shape[2], q.shape[1] // k.shape[1])
    split_tiles = _split_tiles(q.shape[0] if longest is None else longest)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _VarlenAttention.apply(q, k, v, cu_seqlens, scale, split_tiles)
    return _varlen_forward(q, k, v, cu_seqlens, scale, False, split_tiles)[0]


def _split_tiles(reach: int) -> int:
    """SPLIT_TILES of a launch whose rows reach at most `reach` keys: VEXACT_KEY_SPLIT's, or 0 where
    no row reaches key C. A row before key C has the same bits either way (module docstring), and the
    kernel without the fold runs with one accumulator instead of two (session 26, H100: the fold's
    kernel took 1.15 ms for 8 x 1,024 tokens' forward+backward against 0.93 without it; rollouts
    where no row was that long lost 6-12% with the split on; since this rule, session 27 measured
    them within the runs' spread of the unsplit kernel)."""
    keys = key_split()
    return keys // KEY_TILE if keys and reach > keys else 0


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None, shared=None, max_query_len=None
):
    """Triton implementation of `attention.paged_attention` (inputs already checked there).

    No host synchronisation: the grid is (tile_count(T, B), Hkv) from the shapes alone, and sequence
    b's q_len = query_start_loc[b + 1] - query_start_loc[b] must be <= seq_lens[b] (not checked here).
    `shared`: `attention_prefix.shared_prefix_groups`'s groups, or None: their shared key tiles go
    through `attention_prefix_triton` first, and their programs here resume after them.
    `max_query_len` is not read: the grid follows the shapes alone.
    """
    n_tokens, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    block_m, num_warps, num_stages = forward_config(head_dim, group)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out  # [T, Hq, D]
    n_seqs = seq_lens.shape[0]
    if n_tokens == 0 or n_seqs == 0:
        return out
    n_tiles = tile_count(n_tokens, n_seqs, block_m // group)
    thin_sms = _thin_sms(q.device.index) if q.is_cuda else None
    reach = block_table.shape[1] * k_cache.shape[1]  # the most keys a row can reach
    split_tiles = _split_tiles(reach)
    if split_tiles and shared is not None:
        raise ValueError(
            "VEXACT_KEY_SPLIT does not take the shared-prompt groups (their prefix state runs across the "
            "splits; the split is on by default): set VEXACT_KEY_SPLIT=0 with VEXACT_SHARED_PREFIX=1"
        )
    chunks = -(-reach // (split_tiles * KEY_TILE)) if split_tiles else 1
    split = chunks > 1 and split_decode(n_tokens)
    num_stages = paged_stages(head_dim, n_tiles * n_kv, thin_sms, shared is not None, num_stages, split)
    block_table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    seq_lens = seq_lens.to(torch.int32)
    start_loc = query_start_loc.to(torch.int32)
    grid = (n_tiles, n_kv)
    args = (
        q, k_cache, v_cache, out, block_table, seq_lens, start_loc, n_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
    )  # fmt: skip
    meta = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=KEY_TILE, PAGE=k_cache.shape[1],
        PRECISION=_precision(q.dtype), DOT_FP32=_interpreted(), enable_fp_fusion=False, num_warps=num_warps,
        num_stages=num_stages, SPLIT_TILES=split_tiles,
    )  # fmt: skip
    if split:
        _split_decode(q, out, grid, chunks, args, meta, start_loc, n_seqs)
        return out
    resume = dict(SHARED=False)
    if shared is not None:
        if shared.max_members * group > block_m:
            raise ValueError(
                f"shared-prefix groups of {shared.max_members} sequences x {group} query heads exceed the "
                f"{block_m}-row tile; build them with max_members <= {block_m // group}"
            )
        cfg = (block_m, num_warps, num_stages, group, _precision(q.dtype), _interpreted())
        ws_acc, ws_ml = attention_prefix_triton.shared_prefix_forward(
            q, k_cache, v_cache, block_table, start_loc, scale * _LOG2E, shared, cfg,
            _sm_count(q.device.index) if q.is_cuda else None,
        )
        resume = dict(SHARED=True, resume_ptr=shared.tiles, ws_acc_ptr=ws_acc, ws_ml_ptr=ws_ml,
                      stride_wt=ws_acc.stride(0), stride_mt=ws_ml.stride(0))  # fmt: skip
    _paged_fwd_kernel[grid](*args, **meta, **resume)
    return out


# Split decode (a key split): a step of at most this many query tokens runs each key chunk as its own
# program and folds the chunks in a second launch; others fold in one program. Same bits either way
# (speed only). Every such step splits, however many programs it has: one that folded in one program
# would hold two accumulators (255 registers on the H100 against split decode's 219), and grpo's
# 256-row decode steps ran faster split than with a limit of one program an SM (see docs/results.md).
_SPLIT_MAX_TOKENS = 256
# Heads a fold program takes (speed only): a decode step has few tokens, so one program a token left
# most SMs idle (session 25, H200: 16 programs, 7.7 us of an 84 us step).
_FOLD_HEADS = 4


def split_decode(n_tokens: int) -> bool:
    """Whether a split paged launch runs its chunks as separate programs: a step of few tokens (a
    decode step, whose long rows would otherwise each keep one program busy alone). Shapes only, so
    a CUDA graph's capture and replays agree."""
    return n_tokens <= _SPLIT_MAX_TOKENS


def _split_decode(q, out, grid, chunks, args, meta, start_loc, n_seqs):
    """The chunks of each row as separate programs (fp32 workspaces), then `_fold_kernel`; `args` and
    `meta`: `paged_attention`'s launch of `_paged_fwd_kernel`. One chunk a program: session 26 tried
    chunk 0's program taking a prefix of the chunks (folded in registers, or through its workspace
    entry): both compiled to 255 registers and ran the 16-sequence steps 7-40% slower (docs/BENCHMARKS.md)."""
    n_tokens, n_heads, head_dim = q.shape
    part_acc = torch.empty((n_tokens, n_heads, chunks, head_dim), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((n_tokens, n_heads, chunks, 2), dtype=torch.float32, device=q.device)
    part_n = torch.empty(n_tokens, dtype=torch.int32, device=q.device)  # written for every sequence's token
    _paged_fwd_kernel[(*grid, chunks)](
        *args, **meta, PARTIAL=True, part_acc_ptr=part_acc, part_ml_ptr=part_ml, part_n_ptr=part_n,
        stride_pt=n_heads * chunks, CHUNKS=chunks,
    )  # fmt: skip
    heads = min(_FOLD_HEADS, triton.next_power_of_2(n_heads))
    _fold_kernel[(n_tokens, triton.cdiv(n_heads, heads))](
        part_acc, part_ml, part_n, out, start_loc, n_seqs, n_heads * chunks, out.stride(0), out.stride(1), n_heads,
        CHUNKS=chunks, HEAD_DIM=head_dim, HEADS=heads, enable_fp_fusion=False,
    )  # fmt: skip


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Triton implementation of `attention.write_kv_cache` (inputs already checked there).

    Slots < 0 are skipped; slots past the cache are skipped too (checking them would need a host sync).
    """
    n_tokens, n_kv, head_dim = k.shape
    if n_tokens == 0:
        return
    n_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    head_dim_p = triton.next_power_of_2(head_dim)
    cols = triton.next_power_of_2(n_kv * head_dim_p)
    block_t = max(1, 4096 // cols)
    _write_kv_kernel[(triton.cdiv(n_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, n_tokens, n_blocks * block_size, block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_T=block_t, N_KV=n_kv, HEAD_DIM=head_dim, COLS=cols, HEAD_DIM_P=head_dim_p,
    )  # fmt: skip
