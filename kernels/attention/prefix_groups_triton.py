"""`prefix.shared_prefix_groups` in one Triton launch (CUDA): the same three arrays as the
torch composition, which costs some 66 kernel launches of host time at every engine step.

One program walks the step's n sequences in three phases, global memory and a barrier between them:

A. key k_i = the first cache block of a decode of more than one key tile, else -1 - i (alone).
   The stable sort's position of i is pos_i = #{k_j < k_i} + #{j < i: k_j = k_i}; its run of equal
   keys starts at #{k_j < k_i} and is cut into groups of at most MAX_MEMBERS, so i's group starts at
   first_i = #{k_j < k_i} + (#{j < i: k_j = k_i} // MAX_MEMBERS) * MAX_MEMBERS. order[pos_i] = i.
B. each sequence's whole key tiles shared with its group's leader order[first_i]: the leading cache
   blocks equal to the leader's (below its own block count), as keys, capped at its length.
C. a group's tiles are its members' minimum; a group of one, or of no whole tile, is no group.
D. the groups' first positions, listed in order (`starts`), and their number (`count`): the prefix
   kernel's programs walk that list, so a step without groups costs it one wave of programs.

Latency: one program, so each phase's chunk loop is a chain of dependent global loads; the loads of
a chunk are issued together (a key's cache block is read whatever the sequence is) and phases B-D
take BLOCK_S sequences a chunk (256: one chunk a step of up to 256 requests). The default blocks at
8 warps compile for sm_90a without spills (232 registers with Triton 3.6; 64-column table chunks
spilled 1.6 KB).

Only which sequences are grouped, never an attention value, follows from this (the kernels' bits
are the same either way); the tests hold it to the torch composition element for element.
"""

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _elementwise_min, _sum_combine

_BIG = tl.constexpr(2**30)


@triton.jit
def _keys(i, n, table_ptr, stride_t, seq_lens_ptr, qsl_ptr, KEY_TILE: tl.constexpr):
    """(key, is a groupable decode) of sequences i (phase A)."""
    ok = i < n
    q_len = tl.load(qsl_ptr + i + 1, mask=ok, other=0) - tl.load(qsl_ptr + i, mask=ok, other=0)
    seq_len = tl.load(seq_lens_ptr + i, mask=ok, other=0)
    block0 = tl.load(table_ptr + i.to(tl.int64) * stride_t, mask=ok, other=0)  # beside the others
    cand = ok & (q_len == 1) & (seq_len > KEY_TILE)
    return tl.where(cand, block0, -1 - i), cand


@triton.jit(do_not_specialize=["n", "width"])  # the batch must not select another kernel
def _groups_kernel(
    table_ptr,
    stride_t,
    width,
    seq_lens_ptr,
    qsl_ptr,
    n,
    order_ptr,  # out, int32 [n]: by position
    members_ptr,  # out, int32 [n]: by position, a group's size at its first position
    tiles_ptr,  # out, int32 [n]: by sequence, the key tiles its group shares (0: none)
    starts_ptr,  # out, int32 [n]: the groups' first positions in order (entries past count: unset)
    count_ptr,  # out, int32 [1]: the number of groups
    scratch_ptr,  # int32 [4, n]: first position of the group, its size, own position, own tiles
    PAGE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    MAX_MEMBERS: tl.constexpr,
    MEMBERS_P2: tl.constexpr,  # MAX_MEMBERS rounded up to a power of two (tl.arange)
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    first_ptr = scratch_ptr
    size_ptr = scratch_ptr + n
    pos_ptr = scratch_ptr + 2 * n
    own_ptr = scratch_ptr + 3 * n
    # A. positions and groups.
    for i0 in range(0, n, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        key_i, _i = _keys(i, n, table_ptr, stride_t, seq_lens_ptr, qsl_ptr, KEY_TILE)
        less = tl.full([BLOCK_I], 0, tl.int32)
        before = tl.full([BLOCK_I], 0, tl.int32)
        equal = tl.full([BLOCK_I], 0, tl.int32)
        for j0 in range(0, n, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            key_j, _j = _keys(j, n, table_ptr, stride_t, seq_lens_ptr, qsl_ptr, KEY_TILE)
            in_j = (j < n)[None, :]
            eq = in_j & (key_j[None, :] == key_i[:, None])
            less += tl.reduce((in_j & (key_j[None, :] < key_i[:, None])).to(tl.int32), 1, _sum_combine)
            equal += tl.reduce(eq.to(tl.int32), 1, _sum_combine)
            before += tl.reduce((eq & (j[None, :] < i[:, None])).to(tl.int32), 1, _sum_combine)
        cut = before // MAX_MEMBERS * MAX_MEMBERS
        ok = i < n
        tl.store(order_ptr + less + before, i, mask=ok)
        tl.store(first_ptr + i, less + cut, mask=ok)
        tl.store(size_ptr + i, tl.minimum(equal - cut, MAX_MEMBERS), mask=ok)
        tl.store(pos_ptr + i, less + before, mask=ok)
    tl.debug_barrier()
    # B. whole key tiles shared with the group's leader: only members other than the leader compare
    # (the leader shares all its blocks with itself), and a chunk's loop stops once each of its rows
    # has met a differing block, so a step without groups reads no table column.
    for i0 in range(0, n, BLOCK_S):
        i = i0 + tl.arange(0, BLOCK_S)
        ok = i < n
        _b, cand = _keys(i, n, table_ptr, stride_t, seq_lens_ptr, qsl_ptr, KEY_TILE)
        leader = tl.load(order_ptr + tl.load(first_ptr + i, mask=ok, other=0), mask=ok, other=0)
        size = tl.load(size_ptr + i, mask=ok, other=0)
        seq_len = tl.load(seq_lens_ptr + i, mask=ok, other=0)
        blocks = tl.where(cand, tl.minimum((seq_len + PAGE - 1) // PAGE, width), 0)
        compare = tl.where((size >= 2) & (leader != i), blocks, 0)
        same = blocks
        row = table_ptr + i.to(tl.int64) * stride_t
        lead_row = table_ptr + leader.to(tl.int64) * stride_t
        c0 = 0
        bound = tl.reduce(compare, 0, _elementwise_max)
        while c0 < bound:
            c = c0 + tl.arange(0, BLOCK_C)
            inside = c[None, :] < compare[:, None]
            mine = tl.load(row[:, None] + c[None, :], mask=inside, other=0)
            theirs = tl.load(lead_row[:, None] + c[None, :], mask=inside, other=0)
            miss = tl.where(inside & (mine != theirs), c[None, :], _BIG)
            same = tl.minimum(same, tl.reduce(miss, 1, _elementwise_min))
            c0 += BLOCK_C
            bound = tl.reduce(tl.where(same > c0, compare, 0), 0, _elementwise_max)
        own = tl.where(cand, tl.minimum(same * PAGE, seq_len) // KEY_TILE, 0)
        tl.store(own_ptr + i, own, mask=ok)
    tl.debug_barrier()
    # C. a group's tiles: its members' minimum (one gather of the members, one of their tiles).
    k = tl.arange(0, MEMBERS_P2)
    for i0 in range(0, n, BLOCK_S):
        i = i0 + tl.arange(0, BLOCK_S)
        ok = i < n
        first = tl.load(first_ptr + i, mask=ok, other=0)
        size = tl.load(size_ptr + i, mask=ok, other=0)
        pos = tl.load(pos_ptr + i, mask=ok, other=0)
        member_ok = ok[:, None] & (k[None, :] < size[:, None])
        member = tl.load(order_ptr + first[:, None] + k[None, :], mask=member_ok, other=0)
        tiles = tl.load(own_ptr + member, mask=member_ok, other=_BIG)
        shared = tl.reduce(tiles, 1, _elementwise_min)
        grouped = (size >= 2) & (shared >= 1)
        tl.store(tiles_ptr + i, tl.where(grouped, shared, 0), mask=ok)
        tl.store(members_ptr + pos, tl.where(grouped & (pos == first), size, 0), mask=ok)
    tl.debug_barrier()
    # D. the groups' first positions in order, and their count.
    count = 0
    for p0 in range(0, n, BLOCK_S):
        p = p0 + tl.arange(0, BLOCK_S)
        start = (tl.load(members_ptr + p, mask=p < n, other=0) >= 2).to(tl.int32)
        index = count + tl.associative_scan(start, 0, _sum_combine) - 1
        tl.store(starts_ptr + index, p, mask=start > 0)
        count += tl.reduce(start, 0, _sum_combine)
    tl.store(count_ptr, count)


BLOCKS = (64, 256, 16, 256)  # (BLOCK_I, BLOCK_J, BLOCK_C, BLOCK_S) of the launch, at NUM_WARPS
NUM_WARPS = 8


def shared_prefix_groups(block_table, seq_lens, query_start_loc, page, max_members, views, key_tile, blocks=BLOCKS):
    """Fill `views` (order, members, tiles, starts: int32 [n] each; count: int32 [1]) for the step;
    one launch, no host sync. `blocks`: (sequences, sequences compared with them, table columns,
    sequences of phases B-D) per loop step: any values give the same arrays (the tests take small
    ones to walk every loop more than once)."""
    import torch

    n = seq_lens.shape[0]
    if n == 0:
        views[4].zero_()
        return
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    scratch = torch.empty((4, n), dtype=torch.int32, device=seq_lens.device)
    _groups_kernel[(1,)](
        table, table.stride(0), table.shape[1], seq_lens.to(torch.int32), query_start_loc.to(torch.int32), n,
        *views, scratch, PAGE=page, KEY_TILE=key_tile, MAX_MEMBERS=max_members,
        MEMBERS_P2=triton.next_power_of_2(max_members),
        BLOCK_I=blocks[0], BLOCK_J=blocks[1], BLOCK_C=blocks[2], BLOCK_S=blocks[3], num_warps=NUM_WARPS,
    )  # fmt: skip
