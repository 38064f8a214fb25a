"""Triton (CUDA) causal attention over vLLM's paged KV cache: prefill, chunked prefill and decode.

`paged_attention` runs `_paged_fwd_kernel`: program (row tile, kv head) -> BLOCK_M rows of the new
queries of one sequence (its last q_len positions), each reduced by
`core_triton.attend_rows` exactly as the training entry point (`varlen_triton.py`)
reduces the same query: the math, the invariant and the key splits are that module's. The rows'
K/V come from cache slots through the block table. `write_kv_cache` stores the step's new keys and
values first, so cached and new keys reduce in one pass.

CUDA-graph safe: the grid depends on T and B only and every program reads the sequence metadata on
the device (programs without work exit at once). With a key split, a step of few tokens (a decode
step, `split_decode`) runs each key chunk as its own program (`_partial_rows`) and `_fold_kernel`
folds the chunks with the same `fold_chunk`; with shared-prompt groups (`shared=`), the groups'
common key tiles go through `prefix_triton.py` first and the programs here resume after
them (`_resume_rows`). Neither changes a bit.
"""

import functools

import torch
import triton
import triton.language as tl

from . import prefix_triton
from .core_triton import (
    LOG2E,
    attend_chunk,
    attend_rows,
    attend_span,
    dot_precision,
    fold_chunk,
    forward_config,
    head_block,
    interpreted,
    key_split_tiles,
    latent_config,
    load_rope_tile,
    load_tile,
    query_rows,
    seq_of_tile,
    store_tile,
    tile_count,
    tile_start,
)
from .latent import values_in_keys
from .tiles import KEY_TILE

# head_dim -> num_stages of the paged (inference) launches where it differs from FWD_CONFIGS': speed
# only (how many K/V tiles a program has in flight), never a bit. With Triton 3.6 on sm_90a, 3 stages
# give two K/V buffers (81 KB of shared memory), 5 give three (113 KB, still two programs per SM), 7
# four (145 KB, one program per SM: for steps with fewer programs than SMs):
# benchmarks/bench_kernels.py --paged-stages times them.
PAGED_STAGES: dict[int, int] = {}

# head_dim -> num_stages of the launches with shared-prompt groups (`paged_attention(shared=...)`:
# the prefix kernel and the paged kernel resuming after it), where they differ from the above: speed
# only. bench_kernels.py's rollout section on an H100 put grpo-shaped steps at 1.06 of FA3 with 5
# stages against 1.00 with 3, and 0.99 / 0.96 against 0.94 / 0.90 where groups share little.
SHARED_STAGES: dict[int, int] = {128: 5}


# head_dim -> ((programs per SM at most, num_stages), ...): the paged launches of thin steps, whose
# grid leaves the GPU room (at 3 stages two programs fit an SM), keep more K/V tiles in flight per
# program: speed only. On an H100, decode at 16 x 32k keys (128 programs) ran at 0.81 of FA3 with 3
# stages, 0.97 with 5 and 1.00 with 7; at 32 x 6k (256 programs) 0.99 / 1.00 / 0.99. The grid follows
# the step's shapes, so a CUDA graph captured per batch size keeps its depth. Hopper only, like
# SHARED_STAGES (measured there; 7 stages need 148 KB of shared memory a program and 5 stages 113 KB,
# more than an sm_89 GPU has).
THIN_STAGES: dict[int, tuple[tuple[int, int], ...]] = {128: ((1, 7), (2, 5))}
THIN_CAPABILITIES = ((9, 0),)
# head_dim -> num_stages of split decode's chunk launch (a key split; Hopper only, as above): at
# C = 2,048, 5 stages against 3 / 7 ran an 8B uneven step in 73.8 / 77.1 / 87.1 us on the H200 and
# 16 x 5,200 keys in 132.3 / 137.3 / 137.5 us on the H100 (see docs/results.md#split-decode-program).
SPLIT_STAGES: dict[int, int] = {128: 5}


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _thin_sms(device_index: int) -> int | None:
    """The SM count where paged_stages' measured depths apply (THIN_CAPABILITIES), else None."""
    capability = torch.cuda.get_device_capability(device_index)
    return _sm_count(device_index) if capability in THIN_CAPABILITIES else None


def paged_stages(
    head_dim: int, programs: int, sms: int | None, shared: bool, default: int, split: bool = False
) -> int:
    """num_stages of a paged launch of `programs` programs on a GPU of `sms` SMs (None: unknown, as in
    the interpreter, or a GPU these depths were not measured on: then the forward's): PAGED_STAGES
    (empty: a benchmark may fill it), else split decode's (`split`, SPLIT_STAGES), else the thin-step
    depth (THIN_STAGES), else the shared-prompt launches' (SHARED_STAGES), else the forward's `default`.
    Which depth runs changes no bit (tests: test_paged_pipelining_depth_changes_no_bit_cuda)."""
    if head_dim in PAGED_STAGES:
        return PAGED_STAGES[head_dim]
    if not sms:  # the depths below were measured on Hopper only (see THIN_CAPABILITIES)
        return default
    if split:
        return SPLIT_STAGES.get(head_dim, default)
    for per_sm, stages in THIN_STAGES.get(head_dim, ()):
        if programs <= per_sm * sms:
            return stages
    if shared:
        return SHARED_STAGES.get(head_dim, default)
    return default


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
    HEAD_DIM: tl.constexpr,  # query/key head size
    HEAD_DIM_V: tl.constexpr,  # value head size
    BLOCK_D: tl.constexpr,  # their power-of-two tiles (core_triton.head_block)
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SHARED: tl.constexpr = False,  # resume sequences whose first key tiles the shared-prefix kernel did
    resume_ptr=None,  # SHARED: int32 [B], key tiles already attended per sequence (0: none)
    ws_acc_ptr=None,  # SHARED: fp32 [B, Hq, HEAD_DIM_V], their unnormalised accumulators (by sequence)
    ws_ml_ptr=None,  # SHARED: fp32 [B, Hq, 2], their running max and sum
    stride_wt=0,  # SHARED: ws_acc's sequence stride (Hq * HEAD_DIM_V)
    stride_mt=0,  # SHARED: ws_ml's sequence stride (Hq * 2)
    SPLIT_TILES: tl.constexpr = 0,  # key tiles per split (0: none)
    PARTIAL: tl.constexpr = False,  # split decode: program (tile, kv head, chunk) -> that chunk's state
    part_acc_ptr=None,  # PARTIAL: fp32 [T, Hq, chunks, HEAD_DIM_V], each chunk's unnormalised accumulator
    part_ml_ptr=None,  # PARTIAL: fp32 [T, Hq, chunks, 2], its max and sum
    part_n_ptr=None,  # PARTIAL: int32 [T], chunks of each token's row (written for every sequence's token)
    stride_pt=0,  # PARTIAL: entries a token (Hq * chunks): entry (t, h, j) = t * stride_pt + h * chunks + j
    CHUNKS: tl.constexpr = 1,  # PARTIAL: the chunk axis of the workspaces
    HEAD_DIM_R: tl.constexpr = 0,  # the latent's rotary dims (core_triton.attend_tile; 0: none)
    BLOCK_R: tl.constexpr = 16,
):
    """Inference entry: the new queries of each sequence (its last q_len positions) over the paged
    cache; program (tile, kv head) -> BLOCK_M rows, as in training. The programs take the tiles last
    first (a batch's later, longer sequences start first)."""
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    b = seq_of_tile(start_loc_ptr, n_seqs, tile, TOKENS)
    local = tile - tile_start(tl.load(start_loc_ptr + b), b, TOKENS)
    q_start = tl.load(start_loc_ptr + b)
    q_end = tl.load(start_loc_ptr + b + 1)
    first = q_start + local * TOKENS
    if first >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    pos0 = seq_len - q_end + first  # absolute position of token `first`
    token, head, valid, q_pos = query_rows(first, q_end, pos0, kv_head, GROUP, BLOCK_M)
    max_pos = pos0 + tl.minimum(q_end - first, TOKENS) - 1
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + token * stride_qt + head * stride_qh
    q = load_tile(q_rows[:, None] + offs_d[None, :], valid, offs_d, HEAD_DIM, BLOCK_D, True)
    q_r = q
    if HEAD_DIM_R > 0:
        q_r = load_rope_tile(q_rows, valid, HEAD_DIM, HEAD_DIM_R, BLOCK_R)
    if PARTIAL:
        _partial_rows(
            q, q_r, q_pos, pos0, max_pos, seq_len, token, head, valid, k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh, stride_ks, stride_vs, block_table_ptr + b.to(tl.int64) * stride_bt,
            stride_kb, stride_vb, qk_scale, o_ptr, stride_ot, stride_oh, part_acc_ptr, part_ml_ptr, part_n_ptr,
            stride_pt, SPLIT_TILES, CHUNKS, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
            PRECISION, DOT_FP32, HEAD_DIM_R, BLOCK_R,
        )  # fmt: skip
        return
    if SHARED:
        out = _resume_rows(
            q, q_pos, pos0, max_pos, seq_len, head, valid, b, resume_ptr, ws_acc_ptr, ws_ml_ptr,
            stride_wt, stride_mt, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, stride_ks, stride_vs,
            block_table_ptr + b.to(tl.int64) * stride_bt, stride_kb, stride_vb, qk_scale,
            PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32,
        )  # fmt: skip
    else:
        out = _attend_paged(
            q, q_r, q_pos, pos0, max_pos, seq_len, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
            stride_ks, stride_vs, block_table_ptr + b.to(tl.int64) * stride_bt, stride_kb, stride_vb, qk_scale,
            PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, PRECISION, DOT_FP32, SPLIT_TILES,
            HEAD_DIM_R, BLOCK_R,
        )  # fmt: skip
    o_ptrs = o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    store_tile(o_ptrs, out.to(o_ptr.dtype.element_ty), valid, offs_dv, HEAD_DIM_V, BLOCK_DV)


@triton.jit
def _attend_paged(
    q, q_r, q_pos, pos0, max_pos, seq_len, k_base, v_base, stride_ks, stride_vs, block_table_row, stride_kb,
    stride_vb, qk_scale, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT_TILES: tl.constexpr = 0,
    HEAD_DIM_R: tl.constexpr = 0, BLOCK_R: tl.constexpr = 16,
):  # fmt: skip
    """A paged tile's rows from key tile 0: `attend_rows` normalised."""
    out, _ = attend_rows(
        q,
        q_r,
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
        HEAD_DIM_V,
        BLOCK_D,
        BLOCK_DV,
        BLOCK_M,
        BLOCK_N,
        PRECISION,
        DOT_FP32,
        SPLIT_TILES,
        HEAD_DIM_R,
        BLOCK_R,
    )
    return out


@triton.jit
def _partial_rows(
    q, q_r, q_pos, pos0, max_pos, seq_len, token, head, valid, k_base, v_base, stride_ks, stride_vs, block_table_row,
    stride_kb, stride_vb, qk_scale, o_ptr, stride_ot, stride_oh, part_acc_ptr, part_ml_ptr, part_n_ptr, stride_pt,
    SPLIT_TILES: tl.constexpr, CHUNKS: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, HEAD_DIM_R: tl.constexpr = 0,
    BLOCK_R: tl.constexpr = 16,
):  # fmt: skip
    """Split decode: this program's chunk (program_id 2) of its rows' keys, from a fresh state, as
    `attend_rows` computes each chunk, stored unnormalised for `_fold_kernel` (rows whose position
    the chunk does not reach store nothing). Chunk 0's programs store each row's chunk count, and
    the output of rows with one chunk (normalised as `attend_rows` and `_fold_kernel` do), which
    the fold kernel then skips."""
    j = tl.program_id(2)
    last = max_pos // BLOCK_N + 1
    if j * SPLIT_TILES >= last:
        return
    m_j, l_j, acc_j = attend_chunk(
        j, last, q, q_r, q_pos, pos0, seq_len, k_base, v_base, 0, stride_ks, stride_vs, block_table_row,
        stride_kb, stride_vb, qk_scale, SPLIT_TILES, True, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
        BLOCK_N, PRECISION, DOT_FP32, HEAD_DIM_R, BLOCK_R,
    )  # fmt: skip
    offs_dv = tl.arange(0, BLOCK_DV)
    n = q_pos // (SPLIT_TILES * BLOCK_N) + 1  # the row's chunks
    if j == 0:  # each of the token's G rows stores the same count
        tl.store(part_n_ptr + token, n, mask=valid)
        alone = valid & (n == 1)
        o_ptrs = o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        store_tile(o_ptrs, (acc_j / l_j[:, None]).to(o_ptr.dtype.element_ty), alone, offs_dv, HEAD_DIM_V, BLOCK_DV)
    stored = valid & (n > 1) & (q_pos >= j * SPLIT_TILES * BLOCK_N)
    part = token.to(tl.int64) * stride_pt + (head * CHUNKS + j).to(tl.int64)  # the (token, head, chunk) entry
    acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM_V + offs_dv[None, :]
    store_tile(acc_ptrs, acc_j, stored, offs_dv, HEAD_DIM_V, BLOCK_DV)
    tl.store(part_ml_ptr + part * 2, m_j, mask=stored)
    tl.store(part_ml_ptr + part * 2 + 1, l_j, mask=stored)


@triton.jit(do_not_specialize=["n_seqs"])  # the batch size must not select another kernel
def _fold_kernel(
    part_acc_ptr, part_ml_ptr, part_n_ptr, o_ptr, start_loc_ptr, n_seqs, stride_pt, stride_ot, stride_oh, n_heads,
    CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Split decode's second launch: program (token, head block) folds each of its HEADS heads' chunk
    states 0, 1, ... in order with `fold_chunk` (the routine `attend_rows` folds with; a head is a row of
    the [HEADS, BLOCK_D] tile of HEAD_DIM (the value head size) columns: element-wise, so the block size changes no bit) and normalises.
    Tokens past the sequences' (padding: their chunk count is unwritten) and rows of one chunk
    (already stored by `_partial_rows`) exit at once."""
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(start_loc_ptr + n_seqs):
        return
    n = tl.load(part_n_ptr + token)
    if n == 1:
        return
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    real = heads < n_heads
    part = token * stride_pt + (heads * CHUNKS).to(tl.int64)  # chunk 0's (token, head, chunk) entries
    m_i = tl.load(part_ml_ptr + part * 2, mask=real, other=0.0)
    l_i = tl.load(part_ml_ptr + part * 2 + 1, mask=real, other=1.0)
    acc = load_tile(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], real, offs_d, HEAD_DIM, BLOCK_D, True)
    for j in range(1, n):
        m_j = tl.load(part_ml_ptr + (part + j) * 2, mask=real, other=0.0)
        l_j = tl.load(part_ml_ptr + (part + j) * 2 + 1, mask=real, other=1.0)
        acc_ptrs = part_acc_ptr + (part + j)[:, None] * HEAD_DIM + offs_d[None, :]
        acc_j = load_tile(acc_ptrs, real, offs_d, HEAD_DIM, BLOCK_D, True)
        m_i, l_i, acc = fold_chunk(m_i, l_i, acc, m_j, l_j, acc_j, real)
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    store_tile(o_ptrs, out.to(o_ptr.dtype.element_ty), real, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _resume_rows(
    q, q_pos, pos0, max_pos, seq_len, head, valid, b, resume_ptr, ws_acc_ptr, ws_ml_ptr,
    stride_wt, stride_mt, k_base, v_base, stride_ks, stride_vs, block_table_row, stride_kb, stride_vb, qk_scale,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """A paged tile's rows, resumed after the key tiles the shared-prefix kernel attended for its
    sequence (prefix_triton.py; none: from tile 0). Its state was stored in fp32 and is
    read back unchanged, so each row's arithmetic is the same as without the split."""
    t0 = tl.load(resume_ptr + b)
    resumed = valid.to(tl.int32) * t0 > 0  # rows of a sequence its group began
    offs_dv = tl.arange(0, BLOCK_DV)
    seq = b.to(tl.int64)  # resumed rows are a decode's: one query, workspace row b
    ml = ws_ml_ptr + seq * stride_mt + head * 2
    m_i = tl.load(ml, mask=resumed, other=float("-inf"))
    l_i = tl.load(ml + 1, mask=resumed, other=0.0)
    acc_ptrs = ws_acc_ptr + seq * stride_wt + head[:, None] * HEAD_DIM_V + offs_dv[None, :]
    acc = load_tile(acc_ptrs, resumed, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    m_i, l_i, acc = attend_span(
        t0, max_pos // BLOCK_N + 1, m_i, l_i, acc, q, q, q_pos, pos0, seq_len, k_base, v_base, 0, stride_ks,
        stride_vs, block_table_row, stride_kb, stride_vb, qk_scale, True, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
        BLOCK_DV, BLOCK_N, PRECISION, DOT_FP32,
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
    HEAD_DIM: tl.constexpr,  # key head size
    COLS: tl.constexpr,  # next power of two of N_KV * HEAD_DIM_P (tl.arange)
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    HEAD_DIM_V: tl.constexpr,  # value head size, and its COLS and power of two
    COLS_V: tl.constexpr,
    HEAD_DIM_VP: tl.constexpr,
):
    """Copy token t's k [N_KV, HEAD_DIM] and v [N_KV, HEAD_DIM_V] rows to cache slot slot_mapping[t];
    slots < 0 (padding) and slots past the cache are skipped (no host-side check: CUDA-graph safe)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < n_slots)
    slot = tl.where(ok, slot, 0)
    block = slot // block_size
    offset = slot % block_size
    t = t.to(tl.int64)
    _copy_rows(k_ptr + t[:, None] * stride_kt, k_cache_ptr + (block * stride_kcb + offset * stride_kcs)[:, None],
               ok, stride_kh, stride_kch, N_KV, HEAD_DIM, COLS, HEAD_DIM_P)  # fmt: skip
    _copy_rows(v_ptr + t[:, None] * stride_vt, v_cache_ptr + (block * stride_vcb + offset * stride_vcs)[:, None],
               ok, stride_vh, stride_vch, N_KV, HEAD_DIM_V, COLS_V, HEAD_DIM_VP)  # fmt: skip


@triton.jit
def _copy_rows(src, dst, ok, stride_h, stride_ch, N_KV: tl.constexpr, DIM: tl.constexpr, COLS: tl.constexpr,
               DIM_P: tl.constexpr):  # fmt: skip
    """Rows [BLOCK_T] of [N_KV, DIM] heads from src (token rows) to dst (cache slot rows) where ok."""
    col = tl.arange(0, COLS)
    h = col // DIM_P
    d = col % DIM_P
    mask = ok[:, None] & ((h < N_KV) & (d < DIM))[None, :]  # [BLOCK_T, COLS]
    x = tl.load(src + (h * stride_h + d)[None, :], mask=mask)
    tl.store(dst + (h * stride_ch + d)[None, :], x, mask=mask)


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None, shared=None, max_query_len=None
):
    """Triton implementation of `causal.paged_attention` (inputs already checked there).

    No host synchronisation: the grid is (tile_count(T, B), Hkv) from the shapes alone, and sequence
    b's q_len = query_start_loc[b + 1] - query_start_loc[b] must be <= seq_lens[b] (not checked here).
    `shared`: `prefix.shared_prefix_groups`'s groups, or None: their shared key tiles go
    through `prefix_triton` first, and their programs here resume after them.
    `max_query_len` is not read: the grid follows the shapes alone.
    """
    n_tokens, n_heads, head_dim = q.shape
    head_dim_v = v_cache.shape[3]
    latent = values_in_keys(k_cache, v_cache)
    if latent:  # the latent: the key head's first cells are the values; head blocks read the one head
        if shared is not None:
            raise ValueError("the shared-prompt groups do not take the latent (MLA) cache: set VEXACT_SHARED_PREFIX=0")
        group, block_m, num_warps, num_stages = latent_config(
            head_dim_v, head_dim - head_dim_v, n_heads, n_tokens == seq_lens.shape[0], q.dtype == torch.float32
        )
        head_dim_r, head_dim, n_kv = head_dim - head_dim_v, head_dim_v, n_heads // group
    else:
        n_kv, head_dim_r = k_cache.shape[2], 0
        group = n_heads // n_kv
        block_m, num_warps, num_stages = forward_config(head_dim, group, head_dim_v)
    head_stride = 0 if latent else k_cache.stride(2)
    if out is None:
        out = torch.empty((n_tokens, n_heads, head_dim_v), dtype=q.dtype, device=q.device)  # [T, Hq, Dv]
    n_seqs = seq_lens.shape[0]
    if n_tokens == 0 or n_seqs == 0:
        return out
    n_tiles = tile_count(n_tokens, n_seqs, block_m // group)
    thin_sms = _thin_sms(q.device.index) if q.is_cuda else None
    reach = block_table.shape[1] * k_cache.shape[1]  # the most keys a row can reach
    split_tiles = key_split_tiles(reach)
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
        q, k_cache, v_cache, out, block_table, seq_lens, start_loc, n_seqs, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), head_stride,
        v_cache.stride(0), v_cache.stride(1), 0 if latent else v_cache.stride(2), block_table.stride(0),
    )  # fmt: skip
    meta = dict(
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=head_block(head_dim),
        BLOCK_DV=head_block(head_dim_v), BLOCK_M=block_m, BLOCK_N=KEY_TILE, PAGE=k_cache.shape[1],
        PRECISION=dot_precision(q.dtype), DOT_FP32=interpreted(), enable_fp_fusion=False, num_warps=num_warps,
        num_stages=num_stages, SPLIT_TILES=split_tiles, HEAD_DIM_R=head_dim_r,
        BLOCK_R=head_block(head_dim_r) if head_dim_r else 16,
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
        cfg = (block_m, num_warps, num_stages, group, dot_precision(q.dtype), interpreted())
        ws_acc, ws_ml = prefix_triton.shared_prefix_forward(
            q, k_cache, v_cache, block_table, start_loc, scale * LOG2E, shared, cfg,
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
# 256-row decode steps ran faster split than with a limit of one program an SM (see docs/results.md#key-split).
_SPLIT_MAX_TOKENS = 256
# Heads a fold program takes (speed only): a decode step has few tokens, so one program a token left
# most SMs idle (H200: 16 programs took 7.7 us of an 84 us step).
_FOLD_HEADS = 4


def split_decode(n_tokens: int) -> bool:
    """Whether a split paged launch runs its chunks as separate programs: a step of few tokens (a
    decode step, whose long rows would otherwise each keep one program busy alone). Shapes only, so
    a CUDA graph's capture and replays agree."""
    return n_tokens <= _SPLIT_MAX_TOKENS


def _split_decode(q, out, grid, chunks, args, meta, start_loc, n_seqs):
    """The chunks of each row as separate programs (fp32 workspaces), then `_fold_kernel`; `args` and
    `meta`: `paged_attention`'s launch of `_paged_fwd_kernel`. One chunk a program: chunk 0's program
    taking a prefix of the chunks (folded in registers, or through its workspace entry) compiled to
    255 registers and ran the 16-sequence steps 7-40% slower (see docs/results.md#split-decode-program)."""
    n_tokens, n_heads, head_dim_v = out.shape
    part_acc = torch.empty((n_tokens, n_heads, chunks, head_dim_v), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((n_tokens, n_heads, chunks, 2), dtype=torch.float32, device=q.device)
    part_n = torch.empty(n_tokens, dtype=torch.int32, device=q.device)  # written for every sequence's token
    _paged_fwd_kernel[(*grid, chunks)](
        *args, **meta, PARTIAL=True, part_acc_ptr=part_acc, part_ml_ptr=part_ml, part_n_ptr=part_n,
        stride_pt=n_heads * chunks, CHUNKS=chunks,
    )  # fmt: skip
    heads = min(_FOLD_HEADS, triton.next_power_of_2(n_heads))
    _fold_kernel[(n_tokens, triton.cdiv(n_heads, heads))](
        part_acc, part_ml, part_n, out, start_loc, n_seqs, n_heads * chunks, out.stride(0), out.stride(1), n_heads,
        CHUNKS=chunks, HEAD_DIM=head_dim_v, HEADS=heads, BLOCK_D=head_block(head_dim_v), enable_fp_fusion=False,
    )  # fmt: skip


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Triton implementation of `causal.write_kv_cache` (inputs already checked there).

    Slots < 0 are skipped; slots past the cache are skipped too (checking them would need a host sync).
    """
    n_tokens, n_kv, head_dim = k.shape
    head_dim_v = v.shape[2]
    if n_tokens == 0:
        return
    n_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    head_dim_p, head_dim_vp = triton.next_power_of_2(head_dim), triton.next_power_of_2(head_dim_v)
    cols, cols_v = triton.next_power_of_2(n_kv * head_dim_p), triton.next_power_of_2(n_kv * head_dim_vp)
    block_t = max(1, 4096 // max(cols, cols_v))
    _write_kv_kernel[(triton.cdiv(n_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, n_tokens, n_blocks * block_size, block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_T=block_t, N_KV=n_kv, HEAD_DIM=head_dim, COLS=cols, HEAD_DIM_P=head_dim_p, HEAD_DIM_V=head_dim_v,
        COLS_V=cols_v, HEAD_DIM_VP=head_dim_vp,
    )  # fmt: skip
