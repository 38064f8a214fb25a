"""Batch-invariant RMSNorm and fused residual-add + RMSNorm.

Math (per row of H elements, all in fp32):
    x32 = fp32(x)
    y   = x32 * rsqrt(sum(x32 * x32) / H + eps) * fp32(weight)      -> cast to x.dtype
add_rms_norm first forms the new residual r = (fp32(x) + fp32(residual)).to(x.dtype), then
normalises r exactly as above, so the normalised value is the one the next layer's residual holds.

Invariant: the only reduction is the sum of squares over H, one `sum(-1)` over the contiguous last
dim (`reduction.row_sum`), whose order depends on H alone; everything else is elementwise
(`rsqrt` gives the same bits wherever the element sits). A row's output is the same alone or in any
batch. Gradients flow through the torch ops (correct and deterministic).
"""

import torch

from ..checks import check_rms_norm_inputs
from ..dispatch import backend_for
from ..reduction import row_sum


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # [..., H]
    mean_sq = row_sum(x32 * x32) / x.shape[-1]  # [...]
    y = x32 * torch.rsqrt(mean_sq + eps)[..., None] * weight.float()  # [..., H]
    return y.to(x.dtype)


def _add_rms_norm_torch(x, residual, weight, eps):
    new_residual = (x.float() + residual.float()).to(x.dtype)  # [..., H]
    return rms_norm_torch(new_residual, weight, eps), new_residual


def _rms_norm_triton(x, weight, eps):
    from .rms_norm_triton import rms_norm_triton  # imported on first use: no Triton on CPU

    return rms_norm_triton(x, weight, eps)


def _add_rms_norm_triton(x, residual, weight, eps):
    from .rms_norm_triton import add_rms_norm_triton

    return add_rms_norm_triton(x, residual, weight, eps)


_IMPLS = {"torch": rms_norm_torch, "triton": _rms_norm_triton}
_ADD_IMPLS = {"torch": _add_rms_norm_torch, "triton": _add_rms_norm_triton}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. x: [..., H] bf16/fp32, weight: [H] bf16/fp32 -> [..., H] in x.dtype."""
    check_rms_norm_inputs(x, weight, eps)
    return _IMPLS[backend_for(x)](x, weight, float(eps))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is formed in fp32 and stored in x.dtype.

    x, residual: [..., H] of one dtype, weight: [H] -> (out [..., H], new_residual [..., H]).
    """
    check_rms_norm_inputs(x, weight, eps, residual)
    return _ADD_IMPLS[backend_for(x)](x, residual, weight, float(eps))
