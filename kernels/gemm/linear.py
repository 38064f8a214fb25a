"""Batch-invariant linear layer: y = x @ W^T + b.

Math: for each row m and output column n,
    acc[m, n] = sum_k fp32(x[m, k]) * fp32(W[n, k])      (products formed in fp32)
    y[m, n]   = (acc[m, n] + fp32(b[n])).to(out_dtype)   (bias added once, at the end)

Invariant: acc[m, n] is reduced over K by one `sum(-1)` over a contiguous [.., K] fp32 product
tensor, whose addition order depends on K alone (see `reduction.row_sum`). Rows and columns are
processed in chunks only to bound memory; a chunk boundary never falls inside a K reduction, so
each output element has the same bits whatever M, the chunking or the thread count. No BLAS call
appears in the forward: MKL/oneDNN choose kernels and K-splits by M and by thread count.

Backward (training only: correct and deterministic, not batch-invariant) uses fp32 matmuls:
dX = dY @ W, dW = dY^T @ X, db = sum_m dY.
"""

import torch

from ..autograd_utils import backward_without_autocast
from ..checks import (
    SUPPORTED_DTYPES,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_out,
    check_same_device,
)
from ..dispatch import backend_for
from ..reduction import row_sum
from .slices import check_k_slices, combine_partials, tree_sum

# Largest [m, n, K] fp32 product tensor formed at once (elements); only bounds memory.
_PRODUCT_BUDGET = 1 << 20


def _linear_torch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 [M, N] = x2 [M, K] . weight [N, K]^T (+ bias), by elementwise products and row sums."""
    m_total, k = x2.shape
    n_total = weight.shape[0]
    out = torch.empty(m_total, n_total, dtype=torch.float32, device=x2.device)  # [M, N]
    if m_total == 0 or n_total == 0:
        return out
    n_step = max(1, min(n_total, _PRODUCT_BUDGET // max(k, 1)))
    m_step = max(1, _PRODUCT_BUDGET // (n_step * max(k, 1)))
    for n0 in range(0, n_total, n_step):
        w_chunk = weight[n0 : n0 + n_step].float()  # [n, K]
        for m0 in range(0, m_total, m_step):
            x_chunk = x2[m0 : m0 + m_step].float()  # [m, K]
            products = x_chunk[:, None, :] * w_chunk[None, :, :]  # [m, n, K]
            out[m0 : m0 + m_step, n0 : n0 + n_step] = row_sum(products)
    if bias is not None:
        out = out + bias.float()
    return out


def _grads_fp32(grad_out, x2, weight, bias_dtype, needs):
    """(dX, dW, db) by fp32 matmuls; `needs` = (x, weight, bias) flags, db only with a bias dtype."""
    g = grad_out.float()  # [M, N]
    grad_x = grad_w = grad_b = None
    if needs[0]:
        grad_x = (g @ weight.float()).to(x2.dtype)  # [M, K]
    if needs[1]:
        grad_w = (g.t() @ x2.float()).to(weight.dtype)  # [N, K]
    if bias_dtype is not None and needs[2]:
        grad_b = g.sum(0).to(bias_dtype)  # [N]
    return grad_x, grad_w, grad_b


def _grads_cublas(grad_out, x2, weight, bias_dtype, needs):
    """(dX, dW, db) by cuBLAS matmuls in the input dtype (fp32 accumulation) on CUDA; the fp32
    path elsewhere (the Triton interpreter in tests)."""
    if not grad_out.is_cuda:
        return _grads_fp32(grad_out, x2, weight, bias_dtype, needs)
    g = grad_out.to(x2.dtype)  # [M, N]
    grad_x = grad_w = grad_b = None
    if needs[0]:
        grad_x = torch.matmul(g, weight)  # [M, K]
    if needs[1]:
        grad_w = torch.matmul(g.t(), x2)  # [N, K]
    if bias_dtype is not None and needs[2]:
        grad_b = grad_out.float().sum(0).to(bias_dtype)  # [N]
    return grad_x, grad_w, grad_b


def _linear_triton_forward(x2, weight, bias, out_dtype, config_n=None, out=None):
    """The Triton forward without autograd (inputs already checked by `linear`)."""
    from .linear_triton import launch_linear

    return launch_linear(x2, weight, bias, out_dtype, config_n, out=out)


def _linear_torch_forward(x2, weight, bias, out_dtype, config_n=None, out=None):
    y = _linear_torch(x2, weight, bias).to(out_dtype)
    return y if out is None else out.copy_(y)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, out_dtype, config_n=None):  # config_n: no configuration here
        ctx.save_for_backward(x2, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _linear_torch_forward(x2, weight, bias, out_dtype)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        return (*_grads_fp32(grad_out, x2, weight, ctx.bias_dtype, ctx.needs_input_grad), None, None)


class _LinearTritonFunction(torch.autograd.Function):
    """Forward: the batch-invariant Triton kernel (`linear_triton.linear_triton`, imported on first
    use so that importing the kernels never imports Triton). Backward: deterministic, not
    batch-invariant: cuBLAS matmuls in the input dtype (fp32 accumulation) on CUDA, the torch
    path's fp32 matmuls elsewhere (the Triton interpreter in tests)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, out_dtype, config_n=None):
        ctx.save_for_backward(x2, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _linear_triton_forward(x2, weight, bias, out_dtype, config_n)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        return (*_grads_cublas(grad_out, x2, weight, ctx.bias_dtype, ctx.needs_input_grad), None, None)


class _SlicedLinearFunction(torch.autograd.Function):
    """Forward: `slices`' canonical K-sliced order on either backend. Backward: the backend's
    `linear` backward (a gradient does not depend on how the forward ordered its sums)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, out_dtype, k_slices, backend, config_n):
        ctx.save_for_backward(x2, weight)
        ctx.bias_dtype, ctx.backend = (None if bias is None else bias.dtype), backend
        return combine_partials(slice_partials(x2, weight, k_slices, backend, config_n), bias, out_dtype)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        grads = _GRADS[ctx.backend](grad_out, x2, weight, ctx.bias_dtype, ctx.needs_input_grad)
        return (*grads, None, None, None, None)


_IMPLS = {"torch": _LinearFunction.apply, "triton": _LinearTritonFunction.apply}
# The same forwards without an autograd node: taken when no input needs a gradient (the rollout's
# lm_head runs eagerly every decode step, where the Function's bookkeeping is host time).
_FORWARDS = {"torch": _linear_torch_forward, "triton": _linear_triton_forward}


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def slice_partials(x2, weight, k_slices: int, backend: str, config_n: int | None = None) -> list[torch.Tensor]:
    """fp32 [M, N] partial of each of `slices`' K slices, in slice order, on `backend`."""
    step = x2.shape[1] // k_slices
    parts = []
    for s in range(k_slices):
        cols = slice(s * step, (s + 1) * step)
        if backend == "torch":
            parts.append(_linear_torch(x2[:, cols], weight[:, cols], None))
        else:
            from .linear_triton import linear_triton

            parts.append(linear_triton(x2[:, cols], weight[:, cols], None, torch.float32, config_n))
    return parts
_GRADS = {"torch": _grads_fp32, "triton": _grads_cublas}


def linear_grads(
    backend: str,
    grad_out: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias_dtype: torch.dtype | None,
    needs: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dX [M, K], dW [N, K], db [N]) of `linear` as its own backward computes them on `backend`
    (the `backend_for(x)` of the forward call), for callers with their own autograd Function (the
    fused q/k/v projection re-stacks its weight here instead of saving it). grad_out [M, N],
    x2 [M, K]; `needs` = which of (x, weight, bias) to compute; db only with a `bias_dtype`."""
    return _GRADS[backend](grad_out, x2, weight, bias_dtype, needs)


def _check_linear(x, weight, bias, out_dtype, k_slices=1):
    check_dtype("x", x)
    check_dtype("weight", weight)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    check_dim("weight", weight, 2, "[N, K]")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} must end in K = {weight.shape[1]} (weight {tuple(weight.shape)})"
        )
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if bias is not None:
        check_dtype("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use torch.bfloat16 or torch.float32")
    check_k_slices(weight.shape[1], k_slices)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    k_slices: int = 1,
    config_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch-invariant `x @ weight.T + bias` with fp32 accumulation.

    x: [..., K], weight: [N, K] (same dtype as x), bias: [N] or None -> [..., N] in `out_dtype`
    (default x.dtype; the lm_head passes torch.float32). `k_slices` S > 1: K reduced in S equal
    slices combined by `slices`' tree (the order a row-parallel layer split over T | S ranks
    reproduces with `linear_partial` + `combine_partials`). `config_n`: on CUDA, reduce as for a
    weight of that many rows (a column shard reproducing the whole weight's columns). `out`: a
    contiguous [..., N] `out_dtype` tensor, or a 2-D [M, N] one with unit column stride (a column block
    of a wider matrix), to write the result into (inference only; the same bits; a CUDA graph's static
    output, a tensor-parallel exchange buffer).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_linear(x, weight, bias, out_dtype, k_slices)
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    backend = backend_for(x)
    check_out(out, (*x.shape[:-1], weight.shape[0]), out_dtype, x.device, x, weight, bias, row_stride=True)
    if k_slices > 1:
        y = _SlicedLinearFunction.apply(x2, weight, bias, out_dtype, k_slices, backend, config_n)
        if out is not None:
            return out.copy_(y.reshape(out.shape))
    elif out is not None:
        _FORWARDS[backend](x2, weight, bias, out_dtype, config_n, out=out.view(-1, weight.shape[0]))
        return out
    else:
        impls = _IMPLS if _needs_grad(x2, weight, bias) else _FORWARDS
        y = impls[backend](x2, weight, bias, out_dtype, config_n)  # [M, N]
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.no_grad()
def linear_partial(
    x: torch.Tensor, weight: torch.Tensor, k_slices: int, config_n: int | None = None
) -> torch.Tensor:
    """fp32 [..., N]: one tensor-parallel rank's share of a row-parallel `linear(..., k_slices=S)`.

    weight [N, K / T] is the rank's contiguous K shard and x [..., K / T] its input shard; k_slices
    = S / T, the whole layer's slices that fall in the shard. `combine_partials` of the ranks'
    results, in rank order, equals `linear(x, weight, bias, out_dtype, k_slices=S)` bit for bit.
    Inference only (no autograd).
    """
    _check_linear(x, weight, None, torch.float32, k_slices)
    x2 = x.reshape(-1, x.shape[-1])
    out = tree_sum(slice_partials(x2, weight, k_slices, backend_for(x), config_n))
    return out.reshape(*x.shape[:-1], weight.shape[0])


@torch.no_grad()
def warm_up_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config_n: int | None = None,
) -> None:
    """Compile every kernel variant `linear(x, weight, bias, out_dtype, config_n=config_n)` can launch,
    whatever M (one call per tile bucket or CuTe-DSL configuration: `linear_triton.warmup_sizes`).
    Nothing to do off CUDA."""
    if backend_for(weight) != "triton":
        return
    from .linear_triton import num_sms, warmup_sizes

    n, k = weight.shape
    for m in warmup_sizes(n, k, weight.dtype, config_n, num_sms(weight.device)):
        x = torch.zeros(m, k, dtype=weight.dtype, device=weight.device)
        linear(x, weight, bias, out_dtype, config_n=config_n)
