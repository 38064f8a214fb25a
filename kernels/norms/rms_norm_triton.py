"""Triton RMSNorm and fused residual-add + RMSNorm (the CUDA path of `rms_norm.py`).

Math (per row of H elements, fp32), as in `rms_norm.py`:
    r    = x                                      (rms_norm)
    r    = (fp32(x) + fp32(residual)).to(x.dtype) (add_rms_norm; r is also returned, new residual)
    rstd = rsqrt(sum(fp32(r)^2) / H + eps)
    y    = (fp32(r) * rstd * fp32(weight)).to(x.dtype)
Backward (training only; deterministic, not batch-invariant), with xhat = fp32(r) * rstd and
wdy = fp32(dy) * fp32(weight):
    dr = rstd * (wdy - xhat * sum(wdy * xhat) / H)  (+ d new_residual for add_rms_norm)
    dx = d residual = dr,   dweight = sum over rows of fp32(dy) * xhat
dweight: each program sums its own group of _BWD_ROWS_PER_PROGRAM rows, in order, into its own row
of an fp32 [programs, H] buffer, which torch then reduces over dim 0; no atomics, so the result
is the same on every run.

Invariant: one program per row. The row is read in chunks of BLOCK = min(next_pow2(H), MAX_BLOCK)
elements; the squares of chunk c are added elementwise into an fp32 [BLOCK] accumulator in chunk
order, then one `tl.sum` (a tree fixed by BLOCK and the warp count) reduces it. BLOCK, the chunk
count and the warp count are functions of H alone, so a row's bits never depend on the number of
rows in the launch or on its place in the batch.
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from ..autograd_utils import backward_without_autocast
from ..checks import check_rms_norm_inputs

# The reductions are spelled `tl.reduce(x, 0, _sum_combine)` / `_elementwise_max`: exactly what
# `tl.sum` / `tl.max` expand to for fp32, but with no call to a @triton.jit library function, so the
# Triton interpreter can run these kernels in a process whose Triton was imported in compiled mode
# (the tests); the interpreter recognises these combine functions and reduces with numpy.

# Widest chunk of a row held in registers at once; rows wider than this loop over chunks.
# Constant: together with H it fixes the reduction tree of every row.
_MAX_BLOCK = 8192
# Rows per backward program: each program sums its rows' dweight terms in order into its own row
# of an fp32 [cdiv(M, ROWS), H] buffer. Constant, so the backward compiles once per H.
_BWD_ROWS_PER_PROGRAM = 16


def block_for(hidden: int) -> int:
    return min(triton.next_power_of_2(hidden), _MAX_BLOCK)


def warps_for(block: int) -> int:
    return max(1, min(16, block // 512))


@triton.jit
def _load_row_chunk(
    X, R, RES_OUT, x_row, r_row, o_row, offs, mask, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr
):
    """fp32 values of the normalised input r at `offs` (x, or x + residual rounded to x's dtype)."""
    x = tl.load(X + x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(R + r_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(RES_OUT + o_row + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_fwd_kernel(
    X,
    R,
    W,
    Y,
    RES_OUT,
    RSTD,
    stride_x,
    stride_xi,  # x rows may be [T, heads] of a strided 3-D view: row = t * INNER + head
    INNER,  # heads per t (1 for 2-D x); a runtime value, so it never selects another kernel
    stride_r,
    stride_y,
    stride_o,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,  # add_rms_norm: r = x + residual, stored to RES_OUT
    BLOCK: tl.constexpr,  # min(next_pow2(H), _MAX_BLOCK): fixed by H, sets the reduction tree
    NUM_CHUNKS: tl.constexpr,  # cdiv(H, BLOCK): fixed by H
):
    """One row per program: 1. sum of squares, chunk by chunk into an fp32 [BLOCK] vector, then one
    tree sum; 2. rstd; 3. y = r * rstd * w. Chunked rows recompute r in step 3 (same bits)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = (row // INNER) * stride_x + (row % INNER) * stride_xi
    r_row, y_row, o_row = row * stride_r, row * stride_y, row * stride_o
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = cols < H
        x = _load_row_chunk(X, R, RES_OUT, x_row, r_row, o_row, cols, mask, HAS_RESIDUAL, True)
        rstd = tl.rsqrt(tl.math.div_rn(tl.reduce(x * x, 0, _sum_combine), H * 1.0) + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + y_row + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < H
            x = _load_row_chunk(X, R, RES_OUT, x_row, r_row, o_row, offs, mask, HAS_RESIDUAL, True)
            acc += x * x
        rstd = tl.rsqrt(tl.math.div_rn(tl.reduce(acc, 0, _sum_combine), H * 1.0) + eps)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < H
            x = _load_row_chunk(X, R, RES_OUT, x_row, r_row, o_row, offs, mask, HAS_RESIDUAL, False)
            w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + y_row + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DRES,
    DX,
    DW,
    stride_dy,
    stride_x,
    stride_dres,
    stride_dx,
    M,
    H,
    HAS_DRES: tl.constexpr,  # add_rms_norm: the gradient of new_residual is added to dx
    BLOCK: tl.constexpr,  # as in the forward
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,  # _BWD_ROWS_PER_PROGRAM: fixes which rows share a dweight partial sum
):
    """Rows [pid * ROWS, pid * ROWS + ROWS) in order: 1. dot = sum(wdy * xhat); 2. dx; 3. this
    program's dweight partial in DW[pid] (registers for one chunk, else load-add-store by the
    thread that owns each element, so no other program or thread ever touches it)."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dw_row = DW + pid * H
    dw_acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        h_row = tl.where(row < M, H, 0)  # a row past the end reads and writes nothing
        row = tl.minimum(row, M - 1)
        rstd = tl.load(RSTD + row)
        dot = tl.full([BLOCK], 0.0, dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < h_row
            x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
            dot += dy * w * (x * rstd)
        mean_dot = tl.math.div_rn(tl.reduce(dot, 0, _sum_combine), H * 1.0)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < h_row
            x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = x * rstd
            dx = rstd * (dy * w - xhat * mean_dot)
            if HAS_DRES:
                dx += tl.load(DRES + row * stride_dres + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)
            if NUM_CHUNKS == 1:
                dw_acc += dy * xhat
            else:
                part = tl.load(dw_row + offs, mask=mask, other=0.0)
                tl.store(dw_row + offs, part + dy * xhat, mask=mask)
    if NUM_CHUNKS == 1:
        tl.store(dw_row + cols, dw_acc, mask=cols < H)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _forward(x, residual, weight, eps):
    """(y, new_residual or None, rstd [M] fp32); x, residual: [..., H] -> outputs [..., H]."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    if residual is None and x.dim() == 3:  # [T, heads, H] read in place (a strided q/k view: no copy)
        x2, stride_x, stride_xi, inner = x, x.stride(0), x.stride(1), x.shape[1]
    else:
        x2 = x.reshape(-1, hidden)  # [M, H]
        stride_x, stride_xi, inner = x2.stride(0), 0, 1
    r2 = residual.reshape(-1, hidden) if residual is not None else x2
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(y) if residual is not None else y
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)  # [M]
    if rows > 0 and hidden > 0:
        block = block_for(hidden)
        _rms_norm_fwd_kernel[(rows,)](
            x2,
            r2,
            weight,
            y,
            new_res,
            rstd,
            stride_x,
            stride_xi,
            inner,
            r2.stride(0) if residual is not None else 0,
            y.stride(0),
            new_res.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            NUM_CHUNKS=triton.cdiv(hidden, block),
            num_warps=warps_for(block),
        )
    y = y.reshape(x.shape)
    return y, (new_res.reshape(x.shape) if residual is not None else None), rstd


def rms_norm_backward(dy, r, weight, rstd, dres):
    """(dx [..., H] in r.dtype, dweight [H] in weight.dtype); r is the normalised input."""
    hidden = r.shape[-1]
    r2 = r.reshape(-1, hidden)  # [M, H]
    dy2 = dy.reshape(-1, hidden)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    dres2 = None
    if dres is not None:
        dres2 = dres.reshape(-1, hidden)
        if dres2.stride(-1) != 1:
            dres2 = dres2.contiguous()
    n_rows = r2.shape[0]
    dx = torch.empty(r2.shape, dtype=r.dtype, device=r.device)
    programs = max(1, triton.cdiv(n_rows, _BWD_ROWS_PER_PROGRAM))
    dw_partial = torch.zeros(programs, hidden, dtype=torch.float32, device=r.device)  # [G, H]
    if n_rows > 0 and hidden > 0:
        block = block_for(hidden)
        ref = dres2 if dres2 is not None else dy2
        _rms_norm_bwd_kernel[(programs,)](
            dy2,
            r2,
            weight,
            rstd,
            ref,
            dx,
            dw_partial,
            dy2.stride(0),
            r2.stride(0),
            ref.stride(0),
            dx.stride(0),
            n_rows,
            hidden,
            HAS_DRES=dres2 is not None,
            BLOCK=block,
            NUM_CHUNKS=triton.cdiv(hidden, block),
            ROWS=_BWD_ROWS_PER_PROGRAM,
            num_warps=warps_for(block),
        )
    return dx.reshape(r.shape), dw_partial.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, _, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @backward_without_autocast
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd, None)
        return dx, dw, None


class _AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        y, new_res, rstd = _forward(x, residual, weight, eps)
        ctx.save_for_backward(new_res, weight, rstd)
        return y, new_res

    @staticmethod
    @backward_without_autocast
    def backward(ctx, dy, dres):
        new_res, weight, rstd = ctx.saved_tensors
        dr, dw = rms_norm_backward(dy, new_res, weight, rstd, dres)
        d_residual = dr.clone() if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] else dr
        return dr, d_residual, dw, None


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x [..., H] bf16/fp32, weight [H] -> [..., H] in x.dtype."""
    check_rms_norm_inputs(x, weight, eps)
    if _needs_grad(x, weight):
        return _RMSNormFunction.apply(x, weight, float(eps))
    return _forward(x, None, weight, float(eps))[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(r), r) with r = (x + residual) formed in fp32 and stored in x.dtype."""
    check_rms_norm_inputs(x, weight, eps, residual)
    if _needs_grad(x, residual, weight):
        return _AddRMSNormFunction.apply(x, residual, weight, float(eps))
    y, new_res, _ = _forward(x, residual, weight, float(eps))
    return y, new_res
