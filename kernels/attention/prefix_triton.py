"""The shared-prefix step of paged decode attention (CUDA, Triton): the key tiles that a group of
decode sequences read from the same cache blocks, attended once for all of them.

Why: GRPO samples n completions of each prompt; vLLM's prefix cache gives the n sequences the same
cache blocks for the prompt, and one decode step of the paged kernel reads those blocks n times
(once per sequence's program). Here a (group, kv head) puts the group's query rows (up to
BLOCK_M // GROUP sequences of GROUP heads) into one tile and reads each shared key tile once.
`prefix.shared_prefix_groups` finds the groups and lists them (`starts`, `count`); a
fixed grid of programs (`prefix_programs`: about two an SM) walks that list, so a step where no
group forms costs one wave of programs that exit at once (a program per sequence and kv head cost 4
us a layer there: eight waves of empty programs). `_paged_fwd_kernel` (SHARED) then
resumes each sequence from the state written here.

Invariant: a row's arithmetic is the same as in `attend_rows`. The key tiles 0 .. tiles - 1 are
the same keys (the same cache blocks) for every member, wholly below every member's query position,
so they are the unmasked tiles `attend_rows` would take first; each is one `attend_tile` step,
whose dots and row reductions treat every row alike, wherever it sits in the tile (the rows of a
training tile and of a decode tile already sit at different places). The state (running max, sum,
unnormalised fp32 accumulator) goes through fp32 memory unchanged to the resuming program.
"""

import triton
import triton.language as tl

from .core_triton import attend_tile, head_block, load_tile, store_tile
from .tiles import KEY_TILE


@triton.jit
def _shared_prefix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ws_acc_ptr,  # fp32 [B, Hq, HEAD_DIM_V] out: each member row's unnormalised accumulator (by sequence)
    ws_ml_ptr,  # fp32 [B, Hq, 2] out: its running max and sum
    block_table_ptr,
    start_loc_ptr,
    order_ptr,  # int32 [B]: the sequences, each group's members contiguous
    members_ptr,  # int32 [B]: at a group's first position in order, its member count; else 0
    tiles_ptr,  # int32 [B]: per sequence, the key tiles its group attends here (0: none)
    starts_ptr,  # int32 [B]: the groups' first positions in order
    count_ptr,  # int32 [1]: the number of groups
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_wt,
    stride_mt,
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
):
    """Program (g0, kv head): groups g0, g0 + P, ... of the step's list (P programs on axis 0)."""
    kv_head = tl.program_id(1)
    n_groups = tl.load(count_ptr)
    for g in range(tl.program_id(0), n_groups, tl.num_programs(0)):
        p = tl.load(starts_ptr + g)
        _attend_group(
            p, kv_head, q_ptr, k_ptr, v_ptr, ws_acc_ptr, ws_ml_ptr, block_table_ptr, start_loc_ptr, order_ptr,
            members_ptr, tiles_ptr, qk_scale, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
            stride_kb, stride_vb, stride_bt, stride_wt, stride_mt,
            GROUP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, PAGE, PRECISION, DOT_FP32,
        )  # fmt: skip


@triton.jit
def _attend_group(
    p, kv_head, q_ptr, k_ptr, v_ptr, ws_acc_ptr, ws_ml_ptr, block_table_ptr, start_loc_ptr, order_ptr,
    members_ptr, tiles_ptr, qk_scale, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_kb, stride_vb, stride_bt, stride_wt, stride_mt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """The group whose first member sits at position p of order: its shared tiles for one kv head."""
    count = tl.load(members_ptr + p)
    leader = tl.load(order_ptr + p)
    n_tiles = tl.load(tiles_ptr + leader)
    rows = tl.arange(0, BLOCK_M)
    valid = rows // GROUP < count
    member = tl.load(order_ptr + p + rows // GROUP, mask=valid, other=0)
    token = tl.load(start_loc_ptr + member, mask=valid, other=0).to(tl.int64)  # a decode: one query
    head = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = load_tile(q_ptrs, valid, offs_d, HEAD_DIM, BLOCK_D, True)
    q_pos = tl.full([BLOCK_M], 0, dtype=tl.int32)  # unread: the tiles are unmasked
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0, dtype=tl.float32)
    block_table_row = block_table_ptr + leader.to(tl.int64) * stride_bt  # the members' blocks there
    for t in range(0, n_tiles):
        m_i, l_i, acc = attend_tile(
            t, q, q, q_pos, m_i, l_i, acc, 0, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, 0,
            stride_ks, stride_vs, block_table_row, stride_kb, stride_vb, qk_scale,
            False, True, PAGE, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, PRECISION, DOT_FP32,
        )  # fmt: skip
    seq = member.to(tl.int64)  # the workspace rows: one query a member
    ml = ws_ml_ptr + seq * stride_mt + head * 2
    tl.store(ml, m_i, mask=valid)
    tl.store(ml + 1, l_i, mask=valid)
    acc_ptrs = ws_acc_ptr + seq[:, None] * stride_wt + head[:, None] * HEAD_DIM_V + offs_dv[None, :]
    store_tile(acc_ptrs, acc, valid, offs_dv, HEAD_DIM_V, BLOCK_DV)


_PROGRAMS_PER_SM = 2  # the prefix launch's 5-stage pipeline fits two programs an SM


def prefix_programs(n_seqs: int, n_kv: int, sms: int | None) -> int:
    """Programs on the prefix launch's group axis: enough for two a SM over the kv heads (its 5-stage
    pipeline fits two an SM), never more than the step's possible groups (n_seqs // 2); with the SM
    count unknown (the interpreter) one a possible group. Which program takes a group changes no bit."""
    most = max(1, n_seqs // 2)
    return most if sms is None else max(1, min(most, -(-_PROGRAMS_PER_SM * sms // n_kv)))


def shared_prefix_forward(q, k_cache, v_cache, block_table, query_start_loc, scale, shared, cfg, sms=None):
    """Launch `_shared_prefix_kernel`; returns the workspaces (ws_acc, ws_ml) the paged kernel resumes
    from. `scale` is already in log2 units; `cfg`: the paged launch's (block_m, num_warps,
    num_stages, group, precision, interpreted); `sms`: the GPU's SM count (None: unknown)."""
    import torch

    block_m, num_warps, num_stages, group, precision, interpreted = cfg
    n_heads, head_dim, head_dim_v = q.shape[1], q.shape[2], v_cache.shape[3]
    n_seqs, n_kv = shared.order.shape[0], k_cache.shape[2]
    ws_acc = torch.empty((n_seqs, n_heads, head_dim_v), dtype=torch.float32, device=q.device)  # by sequence:
    ws_ml = torch.empty((n_seqs, n_heads, 2), dtype=torch.float32, device=q.device)  # a member has one query
    _shared_prefix_kernel[(prefix_programs(n_seqs, n_kv, sms), n_kv)](
        q, k_cache, v_cache, ws_acc, ws_ml, block_table, query_start_loc, shared.order, shared.members,
        shared.tiles, shared.starts, shared.count, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        ws_acc.stride(0), ws_ml.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=head_block(head_dim),
        BLOCK_DV=head_block(head_dim_v), BLOCK_M=block_m, BLOCK_N=KEY_TILE, PAGE=k_cache.shape[1],
        PRECISION=precision, DOT_FP32=interpreted, enable_fp_fusion=False, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return ws_acc, ws_ml
