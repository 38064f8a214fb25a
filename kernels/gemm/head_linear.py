"""Per-head linear maps, batch-invariant: y[t, h] = x[t, h] @ W[h]^T for every head h.

MLA's absorbed form uses two (model_patches/mla.py): the absorption q_lat[t, h] = q_nope[t, h] @
W_UK[h] (K = qk_nope_head_dim, N = kv_lora_rank) and the up-projection of the attended latent
o[t, h] = o_lat[t, h] @ W_UV[h]^T (K = kv_lora_rank, N = v_head_dim), both weights slices of
`kv_b_proj.weight` per head. The weights are views of that parameter, in whatever layout it gives
(W_UK^T is a transposed view): nothing is copied, so a weight update (verl's weight sync) is seen
at once and the gradient reaches `kv_b_proj.weight` through the view.

Math, for each token t, head h and output column n (T = tokens, H = heads, K, N as above):
    acc[t, h, n] = sum_k fp32(x[t, h, k]) * fp32(W[h, n, k])        (products formed in fp32)
    y[t, h, n]   = acc[t, h, n].to(out_dtype)

Invariant: acc[t, h, n] depends on x[t, h] and W[h] alone, reduced over K in one order fixed by K:
the torch path sums a contiguous fp32 product row (`reduction.row_sum`, as `linear.py`); the Triton
path (head_linear_triton.py) chains one `tl.dot` per HEAD_BLOCK_K step in K order on an fp32
accumulator, what lies past T, N or K read as exact zeros. The weight's strides decide how its tiles
are loaded, never the order of the additions; neither T, the tile of rows a token falls in, nor the
other heads change a value. The two backends agree to rounding, so both sides run the same one.

Backward (training only: correct and deterministic, not batch-invariant), per head
dX[t, h] = dY[t, h] @ W[h], dW[h] = dY[:, h]^T @ X[:, h]: batched cuBLAS matmuls in the input dtype
(fp32 accumulation) for bf16 on CUDA, as `linear`'s backward; fp32 matmuls elsewhere.
"""

import torch

from ..autograd_utils import backward_without_autocast
from ..checks import SUPPORTED_DTYPES, check_dim, check_dtype, check_last_dim_contiguous, check_same_device
from ..dispatch import backend_for
from ..reduction import row_sum

# Largest [t, n, K] fp32 product tensor formed at once (elements); only bounds memory.
_PRODUCT_BUDGET = 1 << 20


def _head_linear_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H, N] by elementwise products and contiguous row sums, head by head."""
    n_tokens, n_heads, k = x.shape
    n = weight.shape[1]
    out = torch.empty(n_tokens, n_heads, n, dtype=torch.float32, device=x.device)  # [T, H, N]
    if n_tokens == 0 or n == 0:
        return out
    n_step = max(1, min(n, _PRODUCT_BUDGET // max(k, 1)))
    t_step = max(1, _PRODUCT_BUDGET // (n_step * max(k, 1)))
    for h in range(n_heads):
        for n0 in range(0, n, n_step):
            w = weight[h, n0 : n0 + n_step].float().contiguous()  # [n, K]: one layout for every view
            for t0 in range(0, n_tokens, t_step):
                xs = x[t0 : t0 + t_step, h].float()  # [t, K]
                out[t0 : t0 + t_step, h, n0 : n0 + n_step] = row_sum((xs[:, None, :] * w[None, :, :]).contiguous())
    return out


def _forward(x, weight, out_dtype, backend):
    if backend == "torch":
        return _head_linear_torch(x, weight).to(out_dtype)
    from .head_linear_triton import head_linear_triton  # imported on first use: no Triton on CPU

    return head_linear_triton(x, weight, out_dtype)


class _HeadLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dtype, backend):
        ctx.save_for_backward(x, weight)
        return _forward(x, weight, out_dtype, backend)

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if grad_out.is_cuda and x.dtype == torch.bfloat16:  # cuBLAS in bf16, fp32 accumulation
            g = grad_out.to(x.dtype).transpose(0, 1)  # [H, T, N]
            if ctx.needs_input_grad[0]:
                grad_x = torch.bmm(g, weight).transpose(0, 1)  # [T, H, K]
            if ctx.needs_input_grad[1]:
                grad_w = torch.bmm(g.transpose(1, 2), x.transpose(0, 1))  # [H, N, K]
            return grad_x, grad_w, None, None
        g = grad_out.float()  # [T, H, N]
        if ctx.needs_input_grad[0]:
            grad_x = torch.einsum("thn,hnk->thk", g, weight.float()).to(x.dtype)  # [T, H, K]
        if ctx.needs_input_grad[1]:
            grad_w = torch.einsum("thn,thk->hnk", g, x.float()).to(weight.dtype)  # [H, N, K]
        return grad_x, grad_w, None, None


def head_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, H, N] = x [T, H, K] @ weight[h]^T per head (fp32 accumulation), in `out_dtype` (default
    x.dtype). weight: [H, N, K] of x's dtype, any strides (a view of a larger parameter); x: unit
    stride in K. Differentiable w.r.t. x and weight."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check_dtype("x", x)
    check_dtype("weight", weight)
    check_dim("x", x, 3, "[T, H, K]")
    check_dim("weight", weight, 3, "[H, N, K]")
    if weight.dtype != x.dtype or weight.shape[0] != x.shape[1] or weight.shape[2] != x.shape[2]:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} must be [H, N, K] of x's dtype for x {tuple(x.shape)} "
            f"{x.dtype} [T, H, K]"
        )
    check_last_dim_contiguous("x", x)
    check_same_device(x=x, weight=weight)
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; use torch.bfloat16 or torch.float32")
    backend = backend_for(x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _HeadLinearFunction.apply(x, weight, out_dtype, backend)
    return _forward(x, weight, out_dtype, backend)
