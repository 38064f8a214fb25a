"""The state layout of design C of the gated delta rule (chunk-anchored, incremental): one cache slot per
running sequence, and how a step's rows split between the step kernel and the chunk kernels.

A sequence's rows form chunks of CHUNK rows anchored at its position 0 (absolute positions that are
multiples of CHUNK). Per slot the cache holds the fp32 state at the sequence's last chunk boundary and,
for the rows of the current partial chunk (at most CHUNK - 1), every per-row value a later row of that
chunk reads (`incremental.py`, "Math"): the normalised key, beta * v rounded to the input dtype, the
gate and beta, the row of the solved triangular system T = (I + A)^-1 and the chunk's delta values V'.
A chunk that fills commits its state and empties the rows. vLLM derives `rows` from its own positions
(num_computed_tokens % CHUNK); a block size that is a multiple of CHUNK puts every cached block's state
on a chunk boundary with no rows held (docs/architecture.md, "Gated DeltaNet").
"""

from dataclasses import dataclass

import torch

# Rows per chunk: the anchor grid of training, prefill, decode and the cache (tests shrink it).
CHUNK = 64


@dataclass
class IncrementalCache:
    """Per slot s (dt: the model's input dtype; R = CHUNK - 1 rows of the partial chunk):"""

    state: torch.Tensor  # [S, HV, DV, DK] fp32: the state at the last chunk boundary (S^T, as design A)
    k: torch.Tensor  # [S, R, HK, DK] dt: l2-normalised keys, rounded to dt (the dot operand)
    x: torch.Tensor  # [S, R, HV, DV] dt: beta * v, rounded to dt (the right operand of U = T x)
    g: torch.Tensor  # [S, R, HV] fp32: the gates g (log decay)
    beta: torch.Tensor  # [S, R, HV] fp32: beta (rounded to dt once, rules.py)
    t: torch.Tensor  # [S, R, HV, CHUNK] fp32: row i of T = (I + A)^-1 (zeros past column i)
    vnew: torch.Tensor  # [S, R, HV, DV] dt: the delta values V' = U - W S of the rows
    rows: torch.Tensor  # [S] int32: rows held in the partial chunk (0 .. CHUNK - 1)

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
            rows=torch.zeros(slots, dtype=torch.int32, device=device),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.state, self.k, self.x, self.g, self.beta, self.t, self.vnew, self.rows)

    def check(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """ValueError unless every tensor has the layout above for k [T, HK, DK], v [T, HV, DV] (contiguous,
        on v's device); returns the slot count S."""
        slots, rows = self.state.shape[0], CHUNK - 1
        hk, d_k, hv, d_v, dt = k.shape[1], k.shape[2], v.shape[1], v.shape[2], v.dtype
        f32 = torch.float32
        want = {
            "state": ((slots, hv, d_v, d_k), f32), "k": ((slots, rows, hk, d_k), dt),
            "x": ((slots, rows, hv, d_v), dt), "g": ((slots, rows, hv), f32), "beta": ((slots, rows, hv), f32),
            "t": ((slots, rows, hv, CHUNK), f32), "vnew": ((slots, rows, hv, d_v), dt), "rows": ((slots,), torch.int32),
        }  # fmt: skip
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != v.device:
                raise ValueError(
                    f"cache.{name} must be a contiguous {dtype} tensor of shape {shape} on {v.device} "
                    f"(IncrementalCache.empty at CHUNK = {CHUNK}), got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        return slots

    @staticmethod
    def bytes_per_slot(hk: int, hv: int, d_k: int, d_v: int, dtype_bytes: int = 2) -> int:
        """Bytes of one slot (one layer): 5,750,404 at Qwen3.5's 16 / 48 heads of 128 in bf16, of which
        3,145,728 are the fp32 state vLLM keeps too."""
        rows = CHUNK - 1
        per_row = hk * d_k * dtype_bytes + hv * (2 * d_v * dtype_bytes + 8 + 4 * CHUNK)
        return hv * d_v * d_k * 4 + rows * per_row + 4


def chunk_map(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence [NC], first row [NC], each sequence's first chunk [N]) of the chunks of rows
    [starts[n], ends[n]), anchored at starts[n] (a host sync: grids are sized by the chunk count)."""
    starts, ends = starts.long().cpu(), ends.long().cpu()
    counts = (ends - starts + CHUNK - 1) // CHUNK
    first = torch.cumsum(counts, 0) - counts
    seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    rows = starts[seq] + (torch.arange(seq.shape[0]) - first[seq]) * CHUNK
    return seq, rows, first


def step_split(cu_seqlens: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Rows of each sequence's step that the step kernel computes (int64 [N], on the device): the rows
    that complete its partial chunk (held > 0), or its single row (a decode at a chunk boundary). The
    rest start on a chunk boundary and go to the chunk kernels. Either path gives a row the same bits;
    the split is only the faster one."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    to_boundary = torch.clamp(CHUNK - held.long(), max=CHUNK) % CHUNK  # 0 at a boundary
    head = torch.minimum(lengths, to_boundary)
    return torch.where((held == 0) & (lengths == 1), lengths, head)


def check_decode_only(decode_only: bool, q: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """A decode-only step has one row a sequence (checked on the host only where cu_seqlens is there)."""
    if not decode_only:
        return
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if q.shape[0] != lengths.shape[0] or (cu_seqlens.device.type == "cpu" and bool((lengths != 1).any())):
        raise ValueError(f"decode_only needs one row a sequence, got cu_seqlens {cu_seqlens.tolist()}")
