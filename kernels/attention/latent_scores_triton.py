"""The latent attention backward's elementwise passes on Triton (`latent.py` holds the formula).

Each pass reads a [rows, keys] block of fp32 products once and writes its results once, where torch's
in-place ops would make a pass per operation (nine over the block's fp32 elements, two of them copies
to the products' dtype). Rows are (query, head) pairs, query-major: row r is query first_query + r // H.

- `probabilities_`: s -> p = exp(s scale - lse ln 2), 0 past the row's query (causal); in place, plus
  p in the products' dtype when that is not fp32.
- `score_gradients_`: dP -> dS = (dP - D) p scale; in place, or to the products' dtype.

Each operation rounds in torch's order (no fused multiply-add); exp is Triton's, so results may differ
from the torch path in the last bits: the backward is deterministic, not bitwise across devices.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024  # keys a program
_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


@triton.jit
def _probabilities_kernel(S, LOW, LSE, n_keys, stride_s, stride_low, first_query, scale, ln2, H: tl.constexpr,
                          BLOCK: tl.constexpr, WRITE_LOW: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_keys
    s = tl.load(S + row * stride_s + cols, mask=live, other=0.0)
    base = tl.load(LSE + row) * ln2
    p = tl.exp(s * scale - base)
    p = tl.where(cols <= first_query + row // H, p, 0.0)
    tl.store(S + row * stride_s + cols, p, mask=live)
    if WRITE_LOW:
        tl.store(LOW + row * stride_low + cols, p.to(LOW.dtype.element_ty), mask=live)


@triton.jit
def _score_gradients_kernel(DP, P, LOW, DELTA, n_keys, stride_dp, stride_p, stride_low, scale, BLOCK: tl.constexpr,
                            WRITE_LOW: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n_keys
    dp = tl.load(DP + row * stride_dp + cols, mask=live, other=0.0)
    p = tl.load(P + row * stride_p + cols, mask=live, other=0.0)
    ds = (dp - tl.load(DELTA + row)) * p * scale
    if WRITE_LOW:
        tl.store(LOW + row * stride_low + cols, ds.to(LOW.dtype.element_ty), mask=live)
    else:
        tl.store(DP + row * stride_dp + cols, ds, mask=live)


def _check(block: torch.Tensor, rows: torch.Tensor) -> None:
    if block.dtype != torch.float32 or block.dim() != 2 or block.stride(1) != 1:
        raise ValueError(f"expected an fp32 [rows, keys] block with unit key stride, got {block.dtype} "
                         f"{tuple(block.shape)} strides {block.stride()}")  # fmt: skip
    if rows.dtype != torch.float32 or rows.shape != (block.shape[0],) or not rows.is_contiguous():
        raise ValueError(f"expected {block.shape[0]} contiguous fp32 row values, got {rows.dtype} {tuple(rows.shape)}")


def _low(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    return None if dtype == torch.float32 else torch.empty(block.shape, dtype=dtype, device=block.device)


def probabilities_(s, lse, first_query: int, n_heads: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """s [rows, keys] fp32 -> p in place (lse [rows] in log2 units); returns p in `dtype` (s itself for fp32)."""
    _check(s, lse)
    low = _low(s, dtype)
    grid = (s.shape[0], triton.cdiv(s.shape[1], BLOCK))
    if s.numel():
        _probabilities_kernel[grid](
            s, s if low is None else low, lse, s.shape[1], s.stride(0), s.stride(0) if low is None else low.stride(0),
            first_query, scale, math.log(2.0), H=n_heads, BLOCK=BLOCK, WRITE_LOW=low is not None, **_OPTIONS,
        )  # fmt: skip
    return s if low is None else low


def score_gradients_(dp, p, delta, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dP [rows, keys] fp32 -> dS = (dP - delta) p scale, in `dtype` (in place for fp32; p fp32 as dP)."""
    _check(dp, delta)
    if p.shape != dp.shape or p.dtype != torch.float32 or p.stride(1) != 1:
        raise ValueError(f"p must be fp32 {tuple(dp.shape)} with unit key stride, got {p.dtype} {tuple(p.shape)}")
    low = _low(dp, dtype)
    grid = (dp.shape[0], triton.cdiv(dp.shape[1], BLOCK))
    if dp.numel():
        _score_gradients_kernel[grid](
            dp, p, dp if low is None else low, delta, dp.shape[1], dp.stride(0), p.stride(0),
            dp.stride(0) if low is None else low.stride(0), scale, BLOCK=BLOCK, WRITE_LOW=low is not None, **_OPTIONS,
        )  # fmt: skip
    return dp if low is None else low
