"""One launch that gathers the sampler's per-row inputs (`sampler.graphs.SamplerGraphs.sample`):
up to three 1-D gathers out_j[i] = src_j[index_j[i]], i < n, optionally with out_0's values below a
threshold set to 0 (vLLM's tiny temperatures meaning greedy).

Why: torch.index_select on 16 rows or fewer runs its small-index kernel, one thread walking the rows
in turn: 13-21 us of GPU time for 16 scalars, three of them before every sampler replay (Qwen3-8B
`decode-small` profile; see docs/results.md#logits-gather). Here one program per 1,024 rows loads them
in parallel. A gather copies values (cast to out's dtype, as `copy_` would): no arithmetic, so the
same bits as index_select, and `where(v < threshold, 0, v)` is masked_fill's own comparison.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _gather_one(out, src, index, src_stride, index_stride, offs, mask, threshold, ZERO_BELOW: tl.constexpr):
    row = tl.load(index + offs * index_stride, mask=mask, other=0)
    v = tl.load(src + row * src_stride, mask=mask)
    if ZERO_BELOW:
        v = tl.where(v < threshold, 0.0, v)
    tl.store(out + offs, v.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])  # one compile whatever the batch size (no stall mid-run)
def _gather_kernel(o0, s0, i0, ss0, is0, o1, s1, i1, ss1, is1, o2, s2, i2, ss2, is2, n, threshold,
                   COUNT: tl.constexpr, ZERO_BELOW: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    _gather_one(o0, s0, i0, ss0, is0, offs, mask, threshold, ZERO_BELOW)
    if COUNT > 1:
        _gather_one(o1, s1, i1, ss1, is1, offs, mask, threshold, False)
    if COUNT > 2:
        _gather_one(o2, s2, i2, ss2, is2, offs, mask, threshold, False)


def gather_rows(triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], zero_below: float | None = None) -> None:
    """For each (out, src, index) of `triples` (one to three, all 1-D on one CUDA device, every out
    contiguous and of index's length n): out[i] = src[index[i]]; with `zero_below`, the first out's
    values below it become 0 afterwards. One launch."""
    if not 1 <= len(triples) <= 3:
        raise ValueError(f"gather_rows takes one to three (out, src, index) triples, got {len(triples)}")
    n = triples[0][0].numel()
    for out, src, index in triples:
        if out.dim() != 1 or src.dim() != 1 or index.dim() != 1 or index.numel() != n or out.numel() != n:
            raise ValueError("gather_rows: 1-D out, src and index, out and index of one length")
        if not out.is_contiguous():
            raise ValueError("gather_rows: a contiguous out")
        if index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"gather_rows: int32 or int64 indices, got {index.dtype}")
    if n == 0:
        return
    padded = list(triples) + [triples[0]] * (3 - len(triples))  # unused slots: never read (COUNT)
    args = [a for out, src, index in padded for a in (out, src, index, src.stride(0), index.stride(0))]
    _gather_kernel[(triton.cdiv(n, _BLOCK),)](
        *args, n, 0.0 if zero_below is None else zero_below,
        COUNT=len(triples), ZERO_BELOW=zero_below is not None, BLOCK=_BLOCK,
    )  # fmt: skip
