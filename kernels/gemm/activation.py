"""Batch-invariant SiLU-and-multiply (the SwiGLU MLP gate).

Math: x = [a | b] along the last dim (I each); out = silu(a) * b with, in fp32,
    silu(a) = a / (1 + exp(-a))
then cast to x.dtype.

Invariant: purely elementwise, built from `exp` and IEEE `+ /  *` only. `torch.sigmoid` and
`F.silu` are avoided on purpose: on CPU their scalar tail loop and vector body round differently,
so an element's bits would depend on where it falls in the tensor (hence on the batch size).
Backward (custom, for a NaN-free gradient at large |a|):
    d silu / d a = s * (1 + a * (1 - s)), s = 1 / (1 + exp(-a)).
"""

import torch

from ..autograd_utils import backward_without_autocast
from ..checks import check_dtype, check_last_dim_contiguous
from ..dispatch import backend_for


def _silu_and_mul_fp32(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    a = x[..., :half].float()  # [..., I]
    b = x[..., half:].float()  # [..., I]
    return a / (1.0 + torch.exp(-a)) * b


class _SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _silu_and_mul_fp32(x).to(x.dtype)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        half = x.shape[-1] // 2
        a = x[..., :half].float()
        b = x[..., half:].float()
        g = grad_out.float()
        s = 1.0 / (1.0 + torch.exp(-a))  # sigmoid(a); exp overflow gives s = 0, never NaN
        grad_a = g * b * s * (1.0 + a * (1.0 - s))
        grad_b = g * (a * s)
        return torch.cat([grad_a, grad_b], dim=-1).to(x.dtype)


def _silu_and_mul_triton(x):
    from .activation_triton import silu_and_mul_triton  # imported on first use: no Triton on CPU

    return silu_and_mul_triton(x)


_IMPLS = {"torch": _SiluAndMulFunction.apply, "triton": _silu_and_mul_triton}


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] bf16/fp32 -> silu(x[..., :I]) * x[..., I:], [..., I] in x.dtype."""
    check_dtype("x", x)
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must end in an even size 2I, got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    return _IMPLS[backend_for(x)](x)


def silu_and_mul_grad(gu: torch.Tensor, grad_a: torch.Tensor) -> torch.Tensor:
    """fp32 [M, 2I]: the gradient w.r.t. gu [M, 2I] = [a | b] of silu_and_mul(gu) for an output
    gradient g = grad_a [M, I] (the formula of `_SiluAndMulFunction.backward`): with
    s = 1 / (1 + exp(-a)), da = g b s (1 + a (1 - s)), db = g a s. Used by the MoE backwards."""
    inter = gu.shape[-1] // 2
    a = gu[:, :inter].float()  # [M, I]
    b = gu[:, inter:].float()  # [M, I]
    g = grad_a.float()
    s = 1.0 / (1.0 + torch.exp(-a))  # exp overflow gives s = 0, never NaN
    return torch.cat([g * b * s * (1.0 + a * (1.0 - s)), g * (a * s)], dim=-1)
