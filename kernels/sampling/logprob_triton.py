"""Triton log-softmax, token log-probs and the fused lm_head log-prob (the CUDA path of `logprob.py`).

Temperature semantics are logit_rules.py's: the callers pass tau as an fp32 [M, 1] tensor, either the
requested temperatures or their `effective_temperature` (each kernel applies that rule itself, in
`effective_tau`, which is idempotent), and every kernel forms scaled = z / tau with `div_rn`, the IEEE
round-to-nearest division (Triton's plain fp32 `/` is an approximation; torch's CUDA `/` is
div.rn, so the bits are torch's `logits / tau`).

Log-softmax of a row of V fp32 logits z, in chunks of TRITON_VOCAB_CHUNK = TRITON_CHUNK_BLOCKS *
TRITON_VOCAB_BLOCK columns (chunk c: columns c * TRITON_VOCAB_CHUNK ..), each chunk read by its own
program (rows x chunks programs, so a few rows still spread over the SMs):
    1. per chunk c: mx_c = max scaled[v]        running elementwise max over its blocks, then one
                                                tree max (exact, order-free)
                    s_c  = sum exp(scaled[v] - mx_c)   added elementwise into an fp32 [TRITON_VOCAB_BLOCK]
                                                vector block by block in index order, then one tree sum
                                                (a chunk whose logits are all -inf: s_c = 0)
    2. per row:     mx = max_c mx_c (exact);  sum = s_0 e_0 + s_1 e_1 + ... in chunk order, one
                    term at a time, e_c = exp(mx_c - mx);  lse = mx + log(sum)
    3. log_prob[v] = scaled[v] - lse
Step 1 is `chunk_lse_kernel`; steps 2 and 3 are `_log_softmax_fwd_kernel`, which writes step 3 for
every v (`log_softmax`, one program per (row, chunk), each forming the row's lse from the same
partials in the same order) or for v = token only, with lse (`token_log_probs`): one kernel source
(the MODE constexpr only picks what step 3 writes), so a token's value is log_softmax's at that
token, bit for bit. Loops run over constexpr counts (TRITON_CHUNK_BLOCKS, NUM_CHUNKS = cdiv(V,
TRITON_VOCAB_CHUNK)): one compilation per vocabulary size.
The blocks (and Triton's exp/log) differ from the torch path's (`logprob.TORCH_VOCAB_BLOCK`, 1024, one
global max), so the two backends agree to rounding, not bitwise: inference and training must run
the same backend.

Invariant: the order of every addition is fixed by V, TRITON_VOCAB_BLOCK and TRITON_CHUNK_BLOCKS
alone (the same for every call), never by the number of rows in the launch, the chunk of rows a row falls in
(`linear_token_log_probs`), or the entry point (`log_softmax`, `token_log_probs`,
`linear_token_log_probs`).

Backward (training only; deterministic): with p = exp(scaled - lse),
    token log-prob:   dz = (onehot(token) - p) * (g / tau)
    log-softmax:      dz = (g - p * sum_v g[v]) / tau
The fused `linear_token_log_probs` recomputes each chunk's logits with the same `linear` call,
writes dz in the hidden dtype, then dH = dz @ W and dW = sum over chunks of dz^T @ H (torch.matmul
in the hidden dtype; chunk results added in chunk order in fp32 when there are several).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

from ..autograd_utils import backward_without_autocast
from ..checks import check_dtype, check_last_dim_contiguous
from ..gemm.linear import linear
from .logit_rules import MIN_TEMPERATURE, mask_logits_

# The reductions are spelled `tl.reduce(x, 0, _sum_combine)` / `_elementwise_max`: exactly what
# `tl.sum` / `tl.max` expand to for fp32, but with no call to a @triton.jit library function, so the
# Triton interpreter can run these kernels in a process whose Triton was imported in compiled mode
# (the tests); the interpreter recognises these combine functions and reduces with numpy.

# Vocabulary columns per block. Fixed for every call: with V it sets the order of the additions.
TRITON_VOCAB_BLOCK = 4096
# Blocks per chunk program (TRITON_VOCAB_CHUNK = 8192 columns: 19 chunks of a 151,936-token vocabulary).
# Fixed with TRITON_VOCAB_BLOCK: it decides which columns share a partial sum.
TRITON_CHUNK_BLOCKS = 2
TRITON_VOCAB_CHUNK = TRITON_CHUNK_BLOCKS * TRITON_VOCAB_BLOCK
# Warps per program; fixed with TRITON_VOCAB_BLOCK (it shapes the tree of each chunk's tl.sum).
LSE_WARPS = 16
# The backward recomputes the logits of at least this many elements a chunk (0.5 GiB in fp32), more rows
# than the forward's chunk where the vocabulary allows: each chunk adds its dW part into the fp32 [V, H]
# sum, and with the forward's 256 rows those adds cost more than the chunk's GEMMs (an eighth of a
# Moonlight-shape trainer step at 8k tokens: 31 adds of 1.3 GB, H200 profile).
BACKWARD_CHUNK_ELEMENTS = 1 << 27

_MODE_ALL = 0  # write log_prob[v] for every v
_MODE_TOKEN = 1  # write log_prob[token] and lse


_MIN_TAU = tl.constexpr(MIN_TEMPERATURE)


@triton.jit
def effective_tau(tau):
    """`logit_rules.effective_temperature` of a requested temperature: 1 for 0 (greedy), MIN_TEMPERATURE
    below it, else itself. Idempotent, so callers may pass requested or effective temperatures;
    applied here, the sampler's decode step launches no torch ops for it."""
    return tl.where(tau == 0, 1.0, tl.where(tau < _MIN_TAU, _MIN_TAU, tau))


@triton.jit
def chunk_lse_kernel(
    Z,
    TAU,
    PART,  # [M, NUM_CHUNKS, 2] fp32: (mx_c, s_c)
    stride_z,
    V,
    BLOCK: tl.constexpr,  # TRITON_VOCAB_BLOCK
    CHUNK_BLOCKS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # cdiv(V, TRITON_VOCAB_CHUNK): fixed by the vocabulary
):
    """Program (row, chunk c): 1. mx_c; 2. s_c, block by block in index order (module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    z_row = Z + row * stride_z
    tau = effective_tau(tl.load(TAU + row))
    cols = chunk * (CHUNK_BLOCKS * BLOCK) + tl.arange(0, BLOCK)
    mx_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for b in range(CHUNK_BLOCKS):
        offs = b * BLOCK + cols
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf"))
        mx_vec = tl.maximum(mx_vec, tl.math.div_rn(z, tau))
    mx = tl.reduce(mx_vec, 0, _elementwise_max)
    acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for b in range(CHUNK_BLOCKS):
        offs = b * BLOCK + cols
        mask = offs < V
        scaled = tl.math.div_rn(tl.load(z_row + offs, mask=mask, other=0.0), tau)
        acc += tl.where(mask & (scaled > float("-inf")), tl.exp(scaled - mx), 0.0)  # no -inf - -inf
    part = PART + (row * NUM_CHUNKS + chunk) * 2
    tl.store(part, mx)
    tl.store(part + 1, tl.reduce(acc, 0, _sum_combine))


@triton.jit
def row_lse(part_row, NUM_CHUNKS: tl.constexpr):
    """lse of one row from its chunks' (mx_c, s_c): 1. mx = max_c mx_c; 2. the rescaled sums added
    one chunk at a time in chunk order (unrolled scalar code: no tree, so no layout can change it)."""
    mx = tl.load(part_row)
    for c in tl.static_range(1, NUM_CHUNKS):
        mx = tl.maximum(mx, tl.load(part_row + 2 * c))
    total = 0.0
    for c in tl.static_range(NUM_CHUNKS):
        total += tl.load(part_row + 2 * c + 1) * tl.exp(tl.load(part_row + 2 * c) - mx)
    return mx + tl.log(total)


@triton.jit
def _log_softmax_fwd_kernel(
    Z,
    TAU,
    TOKENS,
    OUT,
    LSE,
    PART,  # [M, NUM_CHUNKS, 2] from chunk_lse_kernel
    stride_z,
    stride_out,
    V,
    MODE: tl.constexpr,  # _MODE_ALL (grid rows x chunks) or _MODE_TOKEN (grid rows)
    BLOCK: tl.constexpr,  # TRITON_VOCAB_BLOCK
    CHUNK_BLOCKS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    """Program (row, chunk): the row's lse (`row_lse`), then 3. scaled - lse on the chunk (MODE_ALL)
    or at the token, with lse (MODE_TOKEN, one program per row)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    tau = effective_tau(tl.load(TAU + row))
    lse = row_lse(PART + row * NUM_CHUNKS * 2, NUM_CHUNKS)
    if MODE == 1:
        token = tl.load(TOKENS + row).to(tl.int64)
        tl.store(OUT + row, tl.math.div_rn(tl.load(z_row + token), tau) - lse)
        tl.store(LSE + row, lse)
    else:
        cols = tl.program_id(1) * (CHUNK_BLOCKS * BLOCK) + tl.arange(0, BLOCK)
        for b in range(CHUNK_BLOCKS):
            offs = b * BLOCK + cols
            mask = offs < V
            z = tl.load(z_row + offs, mask=mask, other=0.0)
            tl.store(OUT + row * stride_out + offs, tl.math.div_rn(z, tau) - lse, mask=mask)


@triton.jit
def _token_grad_kernel(
    Z,
    TAU,
    TOKENS,
    LSE,
    G,
    DZ,
    stride_z,
    stride_dz,
    V,
    BLOCK: tl.constexpr,  # TRITON_VOCAB_BLOCK (elementwise here; any block would do)
    NUM_BLOCKS: tl.constexpr,  # cdiv(V, TRITON_VOCAB_BLOCK)
):
    """dz[v] = (onehot(token)[v] - exp(z[v] / tau - lse)) * (g / tau), written in DZ's dtype."""
    row = tl.program_id(0).to(tl.int64)
    tau = effective_tau(tl.load(TAU + row))
    lse = tl.load(LSE + row)
    token = tl.load(TOKENS + row).to(tl.int64)
    coef = tl.math.div_rn(tl.load(G + row), tau)
    cols = tl.arange(0, BLOCK)
    for b in range(NUM_BLOCKS):
        offs = b * BLOCK + cols
        mask = offs < V
        z = tl.load(Z + row * stride_z + offs, mask=mask, other=0.0)
        p = tl.exp(tl.math.div_rn(z, tau) - lse)
        dz = (tl.where(offs == token, 1.0, 0.0) - p) * coef
        tl.store(DZ + row * stride_dz + offs, dz.to(DZ.dtype.element_ty), mask=mask)


@triton.jit
def _log_softmax_grad_kernel(
    LOGP,
    G,
    TAU,
    DZ,
    stride_lp,
    stride_g,
    stride_dz,
    V,
    BLOCK: tl.constexpr,  # TRITON_VOCAB_BLOCK
    NUM_BLOCKS: tl.constexpr,  # cdiv(V, TRITON_VOCAB_BLOCK): fixed by the vocabulary
):
    """1. gsum = sum_v g[v] (block by block, then a tree); 2. dz = (g - exp(logp) * gsum) / tau."""
    row = tl.program_id(0).to(tl.int64)
    tau = effective_tau(tl.load(TAU + row))
    cols = tl.arange(0, BLOCK)
    acc = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for b in range(NUM_BLOCKS):
        offs = b * BLOCK + cols
        acc += tl.load(G + row * stride_g + offs, mask=offs < V, other=0.0)
    gsum = tl.reduce(acc, 0, _sum_combine)
    for b in range(NUM_BLOCKS):
        offs = b * BLOCK + cols
        mask = offs < V
        g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0)
        lp = tl.load(LOGP + row * stride_lp + offs, mask=mask, other=0.0)
        tl.store(DZ + row * stride_dz + offs, tl.math.div_rn(g - tl.exp(lp) * gsum, tau), mask=mask)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


def _check_rows(logits: torch.Tensor, tau: torch.Tensor, tokens: torch.Tensor | None) -> None:
    check_dtype("logits", logits, (torch.float32,))
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [M, V] with V > 0, got shape {tuple(logits.shape)}")
    check_last_dim_contiguous("logits", logits)
    check_dtype("tau", tau, (torch.float32,))
    if tau.numel() != logits.shape[0]:
        raise ValueError(f"tau must hold one value per row ({logits.shape[0]}), got {tuple(tau.shape)}")
    if tokens is not None and tuple(tokens.shape) != (logits.shape[0],):
        raise ValueError(f"tokens must have shape ({logits.shape[0]},), got {tuple(tokens.shape)}")


def _launch_rows(logits, tau, tokens, mode, out=None, lse=None):
    """Run the chunk kernel, then the row kernel; returns (out, lse): out [M, V] (mode all) or [M]
    (mode token)."""
    n_rows, vocab = logits.shape
    tau = tau.reshape(-1).contiguous()
    if mode == _MODE_ALL:
        out = torch.empty(n_rows, vocab, dtype=torch.float32, device=logits.device) if out is None else out
        lse = tau  # unused
        tokens = tau  # unused
    else:
        out = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if out is None else out
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if lse is None else lse
        tokens = tokens.contiguous()
    if n_rows > 0:
        n_chunks = triton.cdiv(vocab, TRITON_VOCAB_CHUNK)
        part = torch.empty(n_rows, n_chunks, 2, dtype=torch.float32, device=logits.device)
        sizes = dict(BLOCK=TRITON_VOCAB_BLOCK, CHUNK_BLOCKS=TRITON_CHUNK_BLOCKS, NUM_CHUNKS=n_chunks, num_warps=LSE_WARPS)
        chunk_lse_kernel[(n_rows, n_chunks)](logits, tau, part, logits.stride(0), vocab, **sizes)
        grid = (n_rows, n_chunks if mode == _MODE_ALL else 1)
        _log_softmax_fwd_kernel[grid](
            logits, tau, tokens, out, lse, part, logits.stride(0), out.stride(0), vocab, MODE=mode, **sizes
        )
    return out, lse


def _token_grad(logits, tau, tokens, lse, grad_out, dtype):
    """dz [M, V] in `dtype` of the token log-probs w.r.t. the logits."""
    n_rows, vocab = logits.shape
    dz = torch.empty(n_rows, vocab, dtype=dtype, device=logits.device)
    if n_rows > 0:
        _token_grad_kernel[(n_rows,)](
            logits,
            tau.reshape(-1).contiguous(),
            tokens.contiguous(),
            lse,
            grad_out.float().contiguous(),
            dz,
            logits.stride(0),
            dz.stride(0),
            vocab,
            BLOCK=TRITON_VOCAB_BLOCK,
            NUM_BLOCKS=triton.cdiv(vocab, TRITON_VOCAB_BLOCK),
            num_warps=LSE_WARPS,
        )
    return dz


class _LogSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tau):
        out, _ = _launch_rows(logits, tau, None, _MODE_ALL)
        ctx.save_for_backward(out, tau)
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        log_probs, tau = ctx.saved_tensors
        g = grad_out.float()
        if g.stride(-1) != 1:
            g = g.contiguous()
        dz = torch.empty_like(log_probs)
        if log_probs.shape[0] > 0:
            _log_softmax_grad_kernel[(log_probs.shape[0],)](
                log_probs,
                g,
                tau.reshape(-1).contiguous(),
                dz,
                log_probs.stride(0),
                g.stride(0),
                dz.stride(0),
                log_probs.shape[1],
                BLOCK=TRITON_VOCAB_BLOCK,
                NUM_BLOCKS=triton.cdiv(log_probs.shape[1], TRITON_VOCAB_BLOCK),
                num_warps=LSE_WARPS,
            )
        return dz, None


class _TokenLogProbsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, tau):
        out, lse = _launch_rows(logits, tau, tokens, _MODE_TOKEN)
        ctx.save_for_backward(logits, tokens, tau, lse)
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        logits, tokens, tau, lse = ctx.saved_tensors
        return _token_grad(logits, tau, tokens, lse, grad_out, torch.float32), None, None


def log_softmax_triton(logits: torch.Tensor, tau: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, V] log-probs of fp32 logits [M, V]; tau: fp32 [M, 1] (requested or effective);
    `out`: a contiguous fp32 [M, V] to write them into (no autograd then; checked by the caller)."""
    _check_rows(logits, tau, None)
    if out is None and torch.is_grad_enabled() and logits.requires_grad:
        return _LogSoftmaxFunction.apply(logits, tau)
    return _launch_rows(logits, tau, None, _MODE_ALL, out=out)[0]


def token_log_probs_triton(logits: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """fp32 [M]: log_softmax_triton(logits, tau)[m, tokens[m]], bit for bit."""
    _check_rows(logits, tau, tokens)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogProbsFunction.apply(logits, tokens, tau)
    return _launch_rows(logits, tau, tokens, _MODE_TOKEN)[0]


# ---------------------------------------------------------------------------------------------
# fused lm_head + token log-probs (the trainer's entry point)
# ---------------------------------------------------------------------------------------------


class _LinearTokenLogProbsTritonFunction(torch.autograd.Function):
    """Forward: per row chunk, logits = linear(h, W, fp32) then the token row kernel (the [M, V]
    logits never exist at once). Backward: per chunk (of at least BACKWARD_CHUNK_ELEMENTS logits), the
    same logits again, dz by `_token_grad_kernel` in the hidden dtype, then dH = dz @ W and dW += dz^T @ H."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, tau, chunk_rows, blocked):
        n_rows = hidden.shape[0]
        out = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)  # [M]
        lse = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)  # [M]
        tau = tau.reshape(-1).contiguous()  # [M]
        for r0 in range(0, n_rows, chunk_rows):
            rows = slice(r0, r0 + chunk_rows)
            logits = mask_logits_(linear(hidden[rows], weight, out_dtype=torch.float32), blocked)  # [c, V]
            _launch_rows(logits, tau[rows], tokens[rows], _MODE_TOKEN, out=out[rows], lse=lse[rows])
        ctx.save_for_backward(hidden, weight, tokens, tau, lse)
        ctx.chunk_rows, ctx.blocked = chunk_rows, blocked
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        hidden, weight, tokens, tau, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_rows = hidden.shape[0]
        chunk_rows = max(ctx.chunk_rows, BACKWARD_CHUNK_ELEMENTS // weight.shape[0])
        grad_h = torch.empty_like(hidden) if need_h else None  # [M, H]
        grad_w = None  # [V, H]
        for r0 in range(0, n_rows, chunk_rows):
            rows = slice(r0, r0 + chunk_rows)
            logits = mask_logits_(linear(hidden[rows], weight, out_dtype=torch.float32), ctx.blocked)  # [c, V]
            dz = _token_grad(logits, tau[rows], tokens[rows], lse[rows], grad_out[rows], hidden.dtype)
            del logits
            if need_h:
                grad_h[rows] = torch.matmul(dz, weight)  # [c, H]
            if need_w:
                part = torch.matmul(dz.t(), hidden[rows])  # [V, H]
                if n_rows <= chunk_rows:
                    grad_w = part
                elif grad_w is None:
                    grad_w = part.float()
                else:
                    grad_w += part
        if need_w:
            grad_w = grad_w.to(weight.dtype) if grad_w is not None else torch.zeros_like(weight)
        return grad_h, grad_w, None, None, None, None


def linear_token_log_probs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    tau: torch.Tensor,
    chunk_rows: int,
    blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [M] = token_log_probs_triton(linear(hidden, weight, fp32), tokens, tau), chunked over rows.

    hidden [M, H], weight [V, H] (one dtype), tokens int [M], tau fp32 [M, 1] (greedy already 1),
    blocked: optional bool [V], True where the logit is set to -inf after the GEMM (logit_rules.py).
    """
    if not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    check_dtype("tau", tau, (torch.float32,))
    if hidden.dim() != 2 or tau.numel() != hidden.shape[0] or tuple(tokens.shape) != (hidden.shape[0],):
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [M, H] with tau {tuple(tau.shape)} and tokens "
            f"{tuple(tokens.shape)} holding M values"
        )
    return _LinearTokenLogProbsTritonFunction.apply(hidden, weight, tokens, tau, chunk_rows, blocked)
