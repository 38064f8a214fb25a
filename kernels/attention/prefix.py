"""Decode sequences grouped by the cache blocks they share, for `paged_attention(shared=...)`.

GRPO samples n completions per prompt; with vLLM's prefix cache the n sequences' block tables start
with the same blocks (the prompt's whole blocks). `shared_prefix_groups` finds, on the device and
without a host synchronisation (CUDA-graph safe), the decode sequences (one query) whose tables
start with the same block, in groups of at most `max_members`, and for each group the key tiles
(KEY_TILE keys from position 0) that lie wholly in blocks every member shares with the group's first
member and wholly below every member's query. The Triton paged kernel then attends those tiles once
per group (prefix_triton.py) and each sequence's own tiles after them: the same bits as
without groups (the tiles are the same keys; a row's arithmetic does not depend on the other rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dispatch import backend_for
from .tiles import KEY_TILE


class SharedPrefix(NamedTuple):
    order: torch.Tensor  # int32 [B]: the sequences, each group's members contiguous
    members: torch.Tensor  # int32 [B]: at a group's first position in `order`, its size (>= 2); else 0
    tiles: torch.Tensor  # int32 [B]: per sequence, the key tiles its group attends (0: not grouped)
    starts: torch.Tensor  # int32 [B]: the groups' first positions in `order`, rising (past count: unset)
    count: torch.Tensor  # int32 [1]: the number of groups
    max_members: int  # the largest group: max_members x (Hq / Hkv) rows fit one query tile


def max_group_members(head_dim: int, group: int) -> int:
    """The most decode sequences one group may hold at this head_dim and Hq / Hkv = `group`: their
    query rows (`group` each) must fit one forward query tile (`core_triton.forward_config`'s
    BLOCK_M rows). ValueError where the Triton attention has no configuration."""
    from .core_triton import forward_config

    return forward_config(head_dim, group)[0] // group


def shared_prefix_groups(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    page: int,
    max_members: int,
    out: tuple[torch.Tensor, ...] | None = None,
) -> SharedPrefix:
    """The groups of a step (module docstring). block_table [>= B, W] int32 (a row's entries past
    its sequence may hold anything: only blocks below seq_lens count), seq_lens [B],
    query_start_loc [B + 1], `page` slots per cache block. No host synchronisation;
    `out`: five preallocated int32 buffers of >= B elements (>= 1 for the count) to write into (CUDA
    graphs read them). On CUDA one Triton launch (prefix_groups_triton.py), elsewhere this
    torch composition."""
    if max_members < 2:
        raise ValueError(f"max_members must be at least 2, got {max_members}")
    n = seq_lens.shape[0]
    device = seq_lens.device
    if out is None:
        out = tuple(torch.empty(max(n, 1), dtype=torch.int32, device=device) for _ in range(5))
    if len(out) != 5:
        raise ValueError(f"out must hold 5 buffers (order, members, tiles, starts, count), got {len(out)}")
    views = (*(buf[:n] for buf in out[:4]), out[4][:1])
    if backend_for(seq_lens) == "triton":  # one launch instead of this composition's ~66
        from . import prefix_groups_triton

        table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
        prefix_groups_triton.shared_prefix_groups(
            table, seq_lens, query_start_loc, page, max_members, views, KEY_TILE
        )
        return SharedPrefix(*views, max_members)
    idx = torch.arange(n, device=device)
    seq_lens = seq_lens.long()
    table = block_table[:n].long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    candidate = (q_lens == 1) & (seq_lens > KEY_TILE)  # a decode with at least one whole tile before it
    first_block = torch.where(candidate, table[:, 0], -1 - idx)  # others: a key of their own
    order = torch.argsort(first_block, stable=True)
    key = first_block[order]
    run_start = torch.ones(n, dtype=torch.bool, device=device)
    run_start[1:] = key[1:] != key[:-1]
    run_first = torch.cummax(torch.where(run_start, idx, 0), 0).values  # position of the run's first
    first = run_first + (idx - run_first) // max_members * max_members  # of the group (runs cut up)
    leader = order[first]
    same = (table[order] == table[leader]).long().cumprod(1).sum(1)  # blocks equal from block 0
    keys = torch.minimum(same * page, seq_lens[order])
    tiles = torch.where(candidate[order], keys // KEY_TILE, 0)
    big = torch.iinfo(torch.int64).max
    group_tiles = torch.full((n,), big, device=device).scatter_reduce_(0, first, tiles, "amin")
    size = torch.zeros(n, dtype=torch.long, device=device).scatter_add_(0, first, torch.ones_like(first))
    grouped = (size >= 2) & (group_tiles >= 1) & (group_tiles < big)  # at groups' first positions
    members = torch.where(grouped, size, 0)
    tiles_sorted = torch.where(grouped[first], group_tiles[first], 0)
    per_seq = torch.empty_like(tiles_sorted).scatter_(0, order, tiles_sorted)
    index = torch.where(grouped, grouped.long().cumsum(0) - 1, n)  # the n-th slot: a discard
    starts = torch.zeros(n + 1, dtype=torch.long, device=device).scatter_(0, index, idx)[:n]
    for view, value in zip(views, (order, members, per_seq, starts, grouped.sum().reshape(1)), strict=True):
        view.copy_(value)
    return SharedPrefix(*views, max_members)
