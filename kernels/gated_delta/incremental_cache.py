"""The state layout of design C of the gated delta rule (chunk-anchored, incremental): one cache slot per
running sequence, the chunks of a launch of the chunk kernels, and how a step's rows split between the
decode step and the chunk kernels.

A sequence's rows form chunks of CHUNK rows anchored at its position 0 (absolute positions that are
multiples of CHUNK). Per slot the cache holds the fp32 state at the sequence's last chunk boundary (and
that state rounded to the input dtype, the operand every row's products read: a decode step then reads
half the bytes, `refresh_state_dt` and the kernels that write a state keep it) and,
for the rows of the current partial chunk (at most CHUNK - 1), every per-row value a later row of that
chunk reads (`incremental.py`, "Math"): the normalised key, beta * v rounded to the input dtype, the
gate and beta, the row of the solved triangular system T = (I + A)^-1 and the chunk's delta values V'.
A chunk that fills commits its state and empties the rows. How many rows a slot holds is not stored:
the caller passes each sequence's context length (its tokens before the call; vLLM's
num_computed_tokens), of which the slot holds the last `context % CHUNK`. A block size that is a
multiple of CHUNK puts every cached block's state on a chunk boundary with no rows held
(docs/architecture.md, "Gated DeltaNet"). Each tensor may hold its slots at any stride, each slot
contiguous (vLLM's hybrid cache puts a slot's tensors in one page).
"""

from dataclasses import dataclass

import torch

from .checks import check_slot_layout

# Rows per chunk: the anchor grid of training, prefill, decode and the cache (tests shrink it).
CHUNK = 64


@dataclass
class IncrementalCache:
    """Per slot s (dt: the model's input dtype; R = CHUNK - 1 rows of the partial chunk):"""

    state: torch.Tensor  # [S, HV, DV, DK] fp32: the state at the last chunk boundary (S^T)
    k: torch.Tensor  # [S, R, HK, DK] dt: l2-normalised keys, rounded to dt (the dot operand)
    x: torch.Tensor  # [S, R, HV, DV] dt: beta * v, rounded to dt (the right operand of U = T x)
    g: torch.Tensor  # [S, R, HV] fp32: the gates g (log decay)
    beta: torch.Tensor  # [S, R, HV] fp32: beta (rounded to dt once, rules.py)
    t: torch.Tensor  # [S, R, HV, CHUNK] fp32: row i of T = (I + A)^-1 (zeros past column i)
    vnew: torch.Tensor  # [S, R, HV, DV] dt: the delta values V' = U - W S of the rows
    state_dt: torch.Tensor  # [S, HV, DV, DK] dt: state rounded to dt (to nearest even)

    @classmethod
    def empty(cls, slots: int, hk: int, hv: int, d_k: int, d_v: int, dtype: torch.dtype, device) -> "IncrementalCache":
        rows = CHUNK - 1
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            state=torch.zeros(slots, hv, d_v, d_k, **f32),
            k=torch.zeros(slots, rows, hk, d_k, dtype=dtype, device=device),
            x=torch.zeros(slots, rows, hv, d_v, dtype=dtype, device=device),
            g=torch.zeros(slots, rows, hv, **f32),
            beta=torch.zeros(slots, rows, hv, **f32),
            t=torch.zeros(slots, rows, hv, CHUNK, **f32),
            vnew=torch.zeros(slots, rows, hv, d_v, dtype=dtype, device=device),
            state_dt=torch.zeros(slots, hv, d_v, d_k, dtype=dtype, device=device),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.state, self.k, self.x, self.g, self.beta, self.t, self.vnew, self.state_dt)

    def check(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """ValueError unless every tensor has the layout above for k [T, HK, DK], v [T, HV, DV] (each slot
        contiguous, on v's device); returns the slot count S."""
        slots, rows = self.state.shape[0], CHUNK - 1
        hk, d_k, hv, d_v, dt = k.shape[1], k.shape[2], v.shape[1], v.shape[2], v.dtype
        f32 = torch.float32
        want = {
            "state": ((slots, hv, d_v, d_k), f32), "k": ((slots, rows, hk, d_k), dt),
            "x": ((slots, rows, hv, d_v), dt), "g": ((slots, rows, hv), f32), "beta": ((slots, rows, hv), f32),
            "t": ((slots, rows, hv, CHUNK), f32), "vnew": ((slots, rows, hv, d_v), dt),
            "state_dt": ((slots, hv, d_v, d_k), dt),
        }  # fmt: skip
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != v.device:
                raise ValueError(
                    f"cache.{name} must be a {dtype} tensor of shape {shape} on {v.device} "
                    f"(IncrementalCache.empty at CHUNK = {CHUNK}), got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
            check_slot_layout(f"cache.{name}", t)
        return slots

    @staticmethod
    def bytes_per_slot(hk: int, hv: int, d_k: int, d_v: int, dtype_bytes: int = 2) -> int:
        """Bytes of one slot (one layer): 7,323,264 at Qwen3.5's 16 / 48 heads of 128 in bf16, of which
        3,145,728 are the fp32 state vLLM keeps too and 1,572,864 its bf16 copy."""
        rows = CHUNK - 1
        per_row = hk * d_k * dtype_bytes + hv * (2 * d_v * dtype_bytes + 8 + 4 * CHUNK)
        return hv * d_v * d_k * (4 + dtype_bytes) + rows * per_row


def refresh_state_dt(cache: IncrementalCache, slots: torch.Tensor, has_state: torch.Tensor, held: torch.Tensor,
                     cu_seqlens: torch.Tensor) -> None:
    """cache.state_dt = the state rounded to its dtype, for the slots (int [N], -1: none) whose state a step
    wrote: a sequence that started there, or whose rows reached a chunk boundary (held [N] rows held before
    it). The torch path's (the Triton kernels write both); a host read."""
    lengths = cu_seqlens[1:].long() - cu_seqlens[:-1].long()
    written = slots[(slots >= 0) & (~has_state | (held.long() + lengths >= CHUNK))].long()
    cache.state_dt[written] = cache.state[written].to(cache.state_dt.dtype)


@dataclass
class ChunkMap:
    """The chunks of one launch of the chunk kernels (`chunk_map`): chunk c holds CHUNK rows of sequence
    seq[c], anchored at an absolute position that is a multiple of CHUNK; its row i is packed row
    src[c] + i, in the kernels' scratch at row first[c] + i. A sequence that continues a slot's partial
    chunk (held rows) starts with that chunk: its first rows are the slot's (src before the sequence's
    first row), and its scratch rows lie past the packed rows, so that a chunk's rows are always
    consecutive scratch rows. Every other chunk has first == src."""

    seq: torch.Tensor  # int64 [NC]
    first: torch.Tensor  # int64 [NC]: the scratch row of the chunk's row 0
    src: torch.Tensor  # int64 [NC]: the packed row of the chunk's row 0 (rows before the sequence's: held)
    chunk_start: torch.Tensor  # int64 [N]: each sequence's first chunk
    rows: int  # scratch rows the chunks need (at least the packed rows)

    def to(self, device) -> "ChunkMap":
        seq, first, src, chunk_start = (t.to(device) for t in (self.seq, self.first, self.src, self.chunk_start))
        return ChunkMap(seq=seq, first=first, src=src, chunk_start=chunk_start, rows=self.rows)


def chunk_map(starts: torch.Tensor, ends: torch.Tensor, held: torch.Tensor | None = None) -> ChunkMap:
    """The `ChunkMap` (on the host; device inputs are read once) of rows [starts[n], ends[n]) of each
    sequence, whose slot holds held[n] rows of a partial chunk before starts[n] (None: none); a sequence
    with no rows has no chunk."""
    starts, ends = starts.long().cpu(), ends.long().cpu()
    held = torch.zeros_like(starts) if held is None else held.long().cpu()
    held = torch.where(ends > starts, held, 0)
    anchor = starts - held  # the packed row of the sequence's first chunk's row 0
    counts = torch.where(ends > starts, (ends - anchor + CHUNK - 1) // CHUNK, 0)
    chunk_start = torch.cumsum(counts, 0) - counts
    seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    index = torch.arange(seq.shape[0]) - chunk_start[seq]  # the chunk's place in its sequence
    src = anchor[seq] + index * CHUNK
    packed_rows = int(ends.max()) if ends.numel() else 0
    continues = (index == 0) & (held[seq] > 0)  # starts with held rows: its scratch rows past the packed rows
    first = torch.where(continues, packed_rows + (torch.cumsum(continues.long(), 0) - 1) * CHUNK, src)
    return ChunkMap(seq=seq, first=first, src=src, chunk_start=chunk_start,
                    rows=packed_rows + int(continues.sum()) * CHUNK)  # fmt: skip


@dataclass
class StepSplit:
    """How a cached step's rows go to the kernels (`split_step`), worked out on the host once a step, so
    that a layer's kernels read nothing on the host: a sequence's one row to the decode step, a sequence
    of more rows to the chunk kernels (from its slot's held rows on). Device tensors of N sequences:"""

    held: torch.Tensor  # int64 [N]: the rows of a partial chunk each slot holds (`held_rows`)
    single: torch.Tensor  # bool [N]: one row, the decode step's
    n_single: int  # sequences with single True
    chunks: ChunkMap  # the chunk kernels' chunks (the other sequences')


def split_step(cu_seqlens: torch.Tensor, context_lens: torch.Tensor, has_state: torch.Tensor,
               device: torch.device) -> StepSplit:  # fmt: skip
    """The `StepSplit` of a step from its cu_seqlens [N + 1], context_lens [N] and has_state [N] (host
    tensors: no sync; device tensors are read once) onto `device` in one copy."""
    cu, held = cu_seqlens.long().cpu(), held_rows(has_state.cpu(), context_lens.cpu())
    single = cu[1:] - cu[:-1] == 1
    chunks = chunk_map(cu[:-1] + single.long(), cu[1:], held)
    parts = (held, single.long(), chunks.seq, chunks.first, chunks.src, chunks.chunk_start)
    packed = torch.cat(parts)
    if torch.device(device).type == "cuda":  # pinned: the copy neither waits for the stream nor blocks the host
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True).split([t.shape[0] for t in parts])
    chunks = ChunkMap(seq=packed[2], first=packed[3], src=packed[4], chunk_start=packed[5], rows=chunks.rows)
    return StepSplit(held=packed[0], single=packed[1].bool(), n_single=int(single.sum()), chunks=chunks)


def check_decode_only(decode_only: bool, q: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """A decode-only step has one row a sequence, or none for a padded one (a CUDA graph's padding: its
    rows trail the real ones as padding rows), and as many rows as sequences (lengths checked on the
    host only where cu_seqlens is there)."""
    if not decode_only:
        return
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if q.shape[0] != lengths.shape[0] or (cu_seqlens.device.type == "cpu" and bool((lengths > 1).any())):
        raise ValueError(f"decode_only needs one row a sequence (none for a padded one) and as many rows as "
                         f"sequences, got {q.shape[0]} rows and cu_seqlens {cu_seqlens.tolist()}")


def check_context_lens(context_lens: torch.Tensor, n_seqs: int) -> None:
    """int [N], each sequence's tokens before the call (values checked on CPU only: >= 0)."""
    if context_lens.dtype not in (torch.int32, torch.int64) or tuple(context_lens.shape) != (n_seqs,):
        raise ValueError(f"context_lens must be an int32 or int64 tensor of shape ({n_seqs},), got "
                         f"{context_lens.dtype} {tuple(context_lens.shape)}")  # fmt: skip
    if context_lens.device.type == "cpu" and n_seqs and int(context_lens.min()) < 0:
        raise ValueError(f"context_lens must be >= 0, got {context_lens.tolist()}")


def held_rows(has_state: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the rows of a partial chunk each sequence's slot holds (0 where it starts here)."""
    return torch.where(has_state, context_lens.long() % CHUNK, 0)
