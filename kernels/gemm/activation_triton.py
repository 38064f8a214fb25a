"""Triton SiLU-and-multiply (the CUDA path of `activation.py`), forward and backward.

Math, as in `activation.py`: x = [a | b] along the last dim (I each), in fp32,
    out = a / (1 + exp(-a)) * b                                  cast to x.dtype
Backward, with s = 1 / (1 + exp(-a)) (exp overflow gives s = 0, never NaN):
    da = g * b * s * (1 + a * (1 - s)),   db = g * (a * s)
The divisions are IEEE round-to-nearest (`div_rn`); Triton's plain fp32 `/` is an approximation.

Invariant: purely elementwise; every output element is the same fp32 operations on its own a, b,
so a row's bits never depend on the batch (no scalar-tail/vector-body split as on the CPU).
"""

import torch
import triton
import triton.language as tl

from ..autograd_utils import backward_without_autocast
from ..checks import check_dtype, check_last_dim_contiguous

# Elements of one row half per program; only tiles the elementwise work.
_BLOCK = 1024


@triton.jit
def _silu_and_mul_fwd_kernel(X, Y, stride_x, stride_y, n_inter, BLOCK: tl.constexpr):
    """Program (row, column block): y = a / (1 + exp(-a)) * b."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inter
    a = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n_inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.math.div_rn(a, 1.0 + tl.exp(-a)) * b
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_bwd_kernel(X, G, DX, stride_x, stride_g, stride_dx, n_inter, BLOCK: tl.constexpr):
    """Program (row, column block): da and db from a, b and the output gradient g."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_inter
    a = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n_inter + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-a))
    da = g * b * s * (1.0 + a * (1.0 - s))
    db = g * (a * s)
    tl.store(DX + row * stride_dx + offs, da.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + n_inter + offs, db.to(DX.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [M, L] with a unit last stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _forward(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = _rows(x)  # [M, 2I]
    y = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)  # [M, I]
    if y.numel() > 0:
        grid = (x2.shape[0], triton.cdiv(inter, _BLOCK))
        _silu_and_mul_fwd_kernel[grid](x2, y, x2.stride(0), y.stride(0), inter, BLOCK=_BLOCK, num_warps=4)
    return y.reshape(*x.shape[:-1], inter)


def _backward(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = _rows(x)  # [M, 2I]
    g2 = _rows(grad_out)  # [M, I]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # [M, 2I]
    if g2.numel() > 0:
        grid = (x2.shape[0], triton.cdiv(inter, _BLOCK))
        _silu_and_mul_bwd_kernel[grid](
            x2, g2, dx, x2.stride(0), g2.stride(0), dx.stride(0), inter, BLOCK=_BLOCK, num_warps=4
        )
    return dx.reshape(x.shape)


class _SiluAndMulTritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _forward(x)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return _backward(x, grad_out)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] bf16/fp32 -> silu(x[..., :I]) * x[..., I:], [..., I] in x.dtype."""
    check_dtype("x", x)
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must end in an even size 2I, got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _SiluAndMulTritonFunction.apply(x)
    return _forward(x)
