"""The fused MoE's expert-grouped layout (`experts_triton.py`) in three Triton launches, no host sync.

Legend: n = T * k entries (entry p = t * k + j), E experts, BLOCK_M the tile height, P the capacity.
The layout (a function of the ids alone; it decides who computes a row, never how):
    entries grouped by expert, ascending p within an expert (a stable sort of the ids);
    each expert's run padded to whole BLOCK_M tiles, tile_start[e] its first tile, tile_start[E] the
    tiles in use; rows[r] = the entry at padded row r (-1 = padding), entry_row[p] = p's padded row;
    tile_expert[i] = the expert of tile i (E past the tiles in use);
    P = (cdiv(n, BLOCK_M) + min(E, n)) * BLOCK_M >= sum_e cdiv(n_e, BLOCK_M) * BLOCK_M for every routing,
    so the grids depend on (T, k, E) only and the launches can be captured in a CUDA graph.
An id outside [0, E) goes to no expert: its entry_row is P (a spare row past the end) and it is in no
tile (the combine writes NaN for it).

Kernels (CHUNK entries per program, CHUNK * BLOCK_E fixed):
1. `_count_kernel` (a program per chunk): per-expert entry counts of the chunk.
2. `_scan_kernel` (one program): each chunk's per-expert offset (an exclusive scan over chunks),
   tile_start, tile_expert, and rows filled with -1.
3. `_place_kernel` (a program per chunk): each entry's rank among the earlier entries of its expert in
   its chunk (an inclusive scan of the one-hot [CHUNK, E] over the chunk), so padded row =
   tile_start[e] * BLOCK_M + chunk offset[e] + rank; writes rows and entry_row.
Integer arithmetic only: the layout equals the torch sort-based one exactly (tests).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

_ONE_HOT = 8192  # CHUNK * BLOCK_E: the one-hot tile of a program
_SCAN_ROWS = 32  # chunks per step of the scan over chunks


class Layout(NamedTuple):
    rows: torch.Tensor  # int32 [P]: entry of each padded row, -1 = padding
    tile_expert: torch.Tensor  # int32 [P / block_m]: expert of each M tile, E = unused
    tile_start: torch.Tensor  # int32 [E + 1]: first M tile of each expert
    entry_row: torch.Tensor  # int64 [n]: padded row of each entry (P for an id outside [0, E))
    block_m: int


@triton.jit(do_not_specialize=["n"])
def _count_kernel(IDS, COUNTS, n, n_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(IDS + p, mask=p < n, other=-1)
    lanes = tl.arange(0, BLOCK_E)
    hot = ((e[:, None] == lanes[None, :]) & (e[:, None] < n_experts)).to(tl.int32)  # a bad id: no lane  # [CHUNK, BLOCK_E]
    tl.store(COUNTS + c * BLOCK_E + lanes, tl.reduce(hot, 0, _sum_combine))


@triton.jit(do_not_specialize=["num_chunks", "num_tiles"])
def _scan_kernel(
    COUNTS,  # int32 [num_chunks, BLOCK_E] in: counts; out: each chunk's offset within its expert's run
    TILE_START,  # int32 [E + 1]
    TILE_EXPERT,  # int32 [num_tiles]
    ROWS,  # int32 [num_tiles * BLOCK_M + 1], filled with -1 here
    num_chunks,
    num_tiles,
    n_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SCAN_ROWS: tl.constexpr,
    FILL: tl.constexpr,
):
    lanes = tl.arange(0, BLOCK_E)
    running = tl.full([BLOCK_E], 0, tl.int32)
    r = tl.arange(0, SCAN_ROWS)
    for c0 in range(0, num_chunks, SCAN_ROWS):
        ptrs = COUNTS + (c0 + r)[:, None] * BLOCK_E + lanes[None, :]
        ok = (c0 + r)[:, None] < num_chunks
        counts = tl.load(ptrs, mask=ok, other=0)  # [SCAN_ROWS, BLOCK_E]
        inclusive = tl.associative_scan(counts, 0, _sum_combine)
        tl.store(ptrs, running[None, :] + inclusive - counts, mask=ok)
        running += tl.reduce(counts, 0, _sum_combine)
    tiles = (running + BLOCK_M - 1) // BLOCK_M  # [BLOCK_E], 0 past E
    ends = tl.associative_scan(tiles, 0, _sum_combine)  # first tile after each expert's
    tl.store(TILE_START + 1 + lanes, ends, mask=lanes < n_experts)
    tl.store(TILE_START + lanes, ends - tiles, mask=lanes == 0)
    ends = tl.where(lanes < n_experts, ends, 2147483647)
    t = tl.arange(0, SCAN_ROWS)
    for t0 in range(0, num_tiles, SCAN_ROWS):
        tile = t0 + t
        # tile i belongs to the first expert whose run ends after it: #(experts ending at or before i)
        expert = tl.reduce((ends[None, :] <= tile[:, None]).to(tl.int32), 1, _sum_combine)
        tl.store(TILE_EXPERT + tile, expert, mask=tile < num_tiles)
    f = tl.arange(0, FILL)
    for r0 in range(0, num_tiles * BLOCK_M + 1, FILL):
        tl.store(ROWS + r0 + f, tl.full([FILL], -1, tl.int32), mask=r0 + f < num_tiles * BLOCK_M + 1)


@triton.jit(do_not_specialize=["n", "capacity"])
def _place_kernel(
    IDS, OFFSETS, TILE_START, ROWS, ENTRY_ROW, n, n_experts, capacity,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    live = p < n
    e = tl.load(IDS + p, mask=live, other=-1)
    lanes = tl.arange(0, BLOCK_E)
    hot = ((e[:, None] == lanes[None, :]) & (e[:, None] < n_experts)).to(tl.int32)  # a bad id: no lane
    earlier = tl.associative_scan(hot, 0, _sum_combine) - hot  # same-expert entries before, in the chunk
    first_row = tl.load(TILE_START + lanes, mask=lanes < n_experts, other=0) * BLOCK_M
    base = first_row + tl.load(OFFSETS + c * BLOCK_E + lanes)  # [BLOCK_E]
    row = tl.reduce(hot * (base[None, :] + earlier), 1, _sum_combine)  # [CHUNK]
    valid = (e >= 0) & (e < n_experts)
    row = tl.where(valid, row, capacity)  # bad ids: the spare row past the end
    tl.store(ROWS + row, p.to(tl.int32), mask=live)
    tl.store(ENTRY_ROW + p, row.to(tl.int64), mask=live)


def align(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> Layout:
    """The layout of the module docstring for topk_ids [T, k] (any integer dtype)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    num_tiles = triton.cdiv(n, block_m) + min(n_experts, n)
    capacity = num_tiles * block_m
    tile_start = torch.zeros(n_experts + 1, dtype=torch.int32, device=device)
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return Layout(empty, empty, tile_start, torch.zeros(0, dtype=torch.int64, device=device), block_m)
    block_e = triton.next_power_of_2(n_experts)
    chunk = max(16, _ONE_HOT // block_e)
    num_chunks = triton.cdiv(n, chunk)
    counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=device)
    rows = torch.empty(capacity + 1, dtype=torch.int32, device=device)  # + the spare row
    entry_row = torch.empty(n, dtype=torch.int64, device=device)
    _count_kernel[(num_chunks,)](flat, counts, n, n_experts, CHUNK=chunk, BLOCK_E=block_e)
    _scan_kernel[(1,)](
        counts, tile_start, tile_expert, rows, num_chunks, num_tiles, n_experts,
        BLOCK_M=block_m, BLOCK_E=block_e, SCAN_ROWS=_SCAN_ROWS, FILL=1024,
    )  # fmt: skip
    _place_kernel[(num_chunks,)](
        flat, counts, tile_start, rows, entry_row, n, n_experts, capacity,
        BLOCK_M=block_m, CHUNK=chunk, BLOCK_E=block_e,
    )  # fmt: skip
    return Layout(rows[:capacity], tile_expert, tile_start, entry_row, block_m)
