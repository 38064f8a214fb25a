"""Candidate design B of the gated delta rule: chunks anchored at each sequence's position 0 everywhere.

Training runs `chunked_triton.chunked_forward` over the packed sequences. Inference keeps,
per cache slot, the fp32 state at the sequence's last chunk boundary (a multiple of CHUNK tokens)
and the raw inputs of the partial chunk after it (fewer than CHUNK rows). A step (prefill, chunked
prefill or decode) prepends each sequence's partial rows to its new rows and runs the training kernel
from the boundary state on them: every chunk the kernel sees starts on the training grid, so row p
of a step is row p of a training chunk, zero-padded past the step's last row. The kernel writes the
state after the last chunk it fills (the new boundary); the rows after it become the partial chunk.

Whether zero padding leaves the earlier rows' bits unchanged is the open question of this design:
proven under the CPU interpreter (tests/kernels/gated_delta/test_chunked.py), decided on the GPU by
the same file's CUDA test. Forward only (no backward): an experiment, not dispatched.
"""

from dataclasses import dataclass

import torch

from . import chunked_triton as kernels  # Triton only (the interpreter on CPU tensors)
from .checks import check_gated_delta_inputs, check_slots, check_state


@dataclass
class ChunkAnchoredCache:
    """Per slot: the state at the last chunk boundary and the partial chunk's raw inputs."""

    state: torch.Tensor  # [S, HV, DV, DK] fp32: the state after the sequence's last full chunk
    q: torch.Tensor  # [S, CHUNK - 1, HK, DK]: the partial chunk's rows, in the inputs' dtype
    k: torch.Tensor  # [S, CHUNK - 1, HK, DK]
    v: torch.Tensor  # [S, CHUNK - 1, HV, DV]
    a: torch.Tensor  # [S, CHUNK - 1, HV]
    b: torch.Tensor  # [S, CHUNK - 1, HV]
    rows: torch.Tensor  # [S] int64 on the CPU: rows held in the partial chunk

    @classmethod
    def empty(
        cls, slots: int, hk: int, hv: int, d_k: int, d_v: int, dtype: torch.dtype, device
    ) -> "ChunkAnchoredCache":
        rows = kernels.CHUNK - 1
        return cls(
            state=torch.zeros(slots, hv, d_v, d_k, dtype=torch.float32, device=device),
            q=torch.zeros(slots, rows, hk, d_k, dtype=dtype, device=device),
            k=torch.zeros(slots, rows, hk, d_k, dtype=dtype, device=device),
            v=torch.zeros(slots, rows, hv, d_v, dtype=dtype, device=device),
            a=torch.zeros(slots, rows, hv, dtype=dtype, device=device),
            b=torch.zeros(slots, rows, hv, dtype=dtype, device=device),
            rows=torch.zeros(slots, dtype=torch.int64),
        )


def chunked_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu_seqlens) -> torch.Tensor:
    """Training forward of design B: o [T, HV, DV] of packed sequences from zero states (inputs as
    `recurrent.gated_delta_rule`). Forward only."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, a, b, A_log, dt_bias)):
        raise ValueError("the chunk-anchored candidate has no backward: call it under torch.no_grad()")
    none = torch.full((n_seqs,), -1, dtype=torch.int64, device=v.device)
    dummy = torch.empty(1, v.shape[1], v.shape[2], q.shape[2], dtype=torch.float32, device=v.device)
    return kernels.chunked_forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, dummy, none, dummy, none)


def assemble_step(q, k, v, a, b, cu_seqlens, cache, slots, has_state):
    """The step's kernel inputs: each sequence's partial rows then its new rows, packed.

    Returns (q, k, v, a, b, cu_seqlens of the assembled rows, held [N]: partial rows per sequence)."""
    cu = cu_seqlens.long().tolist()
    held = [int(cache.rows[s]) if h else 0 for s, h in zip(slots.tolist(), has_state.tolist())]
    parts = {name: [] for name in "qkvab"}
    for n, slot in enumerate(slots.tolist()):
        for name, new, old in (
            ("q", q, cache.q),
            ("k", k, cache.k),
            ("v", v, cache.v),
            ("a", a, cache.a),
            ("b", b, cache.b),
        ):
            parts[name] += [old[slot, : held[n]], new[cu[n] : cu[n + 1]]]
    lengths = [held[n] + cu[n + 1] - cu[n] for n in range(len(held))]
    new_cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(cu_seqlens.device)
    packed = [torch.cat(parts[name]) for name in "qkvab"]
    return (*packed, new_cu, held)


def chunk_anchored_step(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache: ChunkAnchoredCache, slots, has_state
):
    """o [T, HV, DV] of a prefill, chunked-prefill or decode step under design B; the cache (boundary
    states and partial chunks of the slots) is updated. Inputs as `recurrent.gated_delta_rule_cached`."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    check_state("cache.state", cache.state, None, v, k)
    check_slots(slots, has_state, n_seqs, cache.state.shape[0])
    aq, ak, av, aa, ab, acu, held = assemble_step(q, k, v, a, b, cu_seqlens, cache, slots, has_state)
    idx = slots.long().to(v.device)
    starts = ~has_state.to(v.device)
    cache.state[idx[starts]] = 0.0  # a sequence's first boundary is position 0, its state zero
    read = torch.where(starts, -1, idx)
    o_all = kernels.chunked_forward(
        aq, ak, av, aa, ab, A_log, dt_bias, acu, cache.state, read, cache.state, idx
    )
    bounds = acu.tolist()
    keep = torch.cat([torch.arange(bounds[n] + held[n], bounds[n + 1]) for n in range(n_seqs)])
    for n, slot in enumerate(slots.tolist()):
        length = bounds[n + 1] - bounds[n]
        tail = length % kernels.CHUNK  # rows after the last full chunk: the new partial chunk
        for old, rows in ((cache.q, aq), (cache.k, ak), (cache.v, av), (cache.a, aa), (cache.b, ab)):
            old[slot, :tail] = rows[bounds[n + 1] - tail : bounds[n + 1]]
        cache.rows[slot] = tail
    return o_all[keep.to(v.device)]
