"""THE log-prob function, shared by the sampler (inference) and the trainer.

Logits z are fp32 (the lm_head is `linear(hidden, weight, out_dtype=torch.float32)`). The temperature
rule and the vocabulary mask are logit_rules.py's (the one definition both sides use): a requested
temperature becomes its `effective_temperature`, the logits are divided by it once (fp32 true
division by a per-row tensor), and masked ids get -inf right after the lm_head GEMM.

Log-softmax, per row of V scaled logits:
    mx  = max_v scaled[v]                                        exact, order-free
    e   = exp(scaled - mx), zero-padded to a multiple of TORCH_VOCAB_BLOCK = 1024
    sum = ((b_0 + b_1) + b_2) + ...,  b_i = sum of e over block i  (1024-long sums, then in order)
    lse = mx + log(sum);  log_probs = scaled - lse
Invariant: every sum has a fixed length (1024, then the blocks one by one in index order) and
everything else is elementwise, so a row's log-probs are the same bits alone or in any batch, and
`linear_token_log_probs` (fused, chunked over rows, the trainer's entry point) equals
`token_log_probs(linear(...))` bit for bit. The CUDA path (logprob_triton.py) has its own fixed
blocks (TRITON_TORCH_VOCAB_BLOCK): the two backends agree to rounding, so both sides run the same one.
"""

import torch
import torch.nn.functional as F

from ..autograd_utils import backward_without_autocast
from ..checks import (
    check_dim,
    check_dtype,
    check_logits,
    check_out,
    check_same_device,
    check_temperature,
    check_tokens,
)
from ..dispatch import backend_for
from ..gemm.linear import linear
from ..reduction import row_sum, sequential_sum
from .logit_rules import blocked_ids, mask_logits_, temperature_column

# Vocabulary entries per block of the torch path's exp-sum. Fixed: it sets the order of the additions.
TORCH_VOCAB_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# log-softmax
# ---------------------------------------------------------------------------------------------


def _scaled_and_lse(logits: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [M, V] = logits / tau and its row logsumexp [M] in the fixed block order."""
    n_rows, vocab = logits.shape
    scaled = logits / tau  # [M, V]
    mx = scaled.amax(-1, keepdim=True).detach()  # [M, 1]; detached: logsumexp is shift-invariant
    e = torch.exp(scaled - mx)  # [M, V]
    pad = (-vocab) % TORCH_VOCAB_BLOCK
    if pad:
        e = F.pad(e, (0, pad))  # [M, nb * 1024]
    block_sums = row_sum(e.reshape(n_rows, e.shape[1] // TORCH_VOCAB_BLOCK, TORCH_VOCAB_BLOCK))  # [M, nb]
    lse = mx[:, 0] + torch.log(sequential_sum(block_sums))  # [M]
    return scaled, lse


def _log_softmax_torch(logits, tau, out=None):
    scaled, lse = _scaled_and_lse(logits, tau)
    return torch.sub(scaled, lse[:, None], out=out)


def _token_log_probs_torch(logits, tokens, tau):
    scaled, lse = _scaled_and_lse(logits, tau)
    return scaled.gather(1, tokens.long()[:, None])[:, 0] - lse  # same bits as log_softmax gathered


def _log_softmax_triton(logits, tau, out=None):
    from .logprob_triton import log_softmax_triton  # imported on first use: no Triton on CPU

    return log_softmax_triton(logits, tau, out=out)


def _token_log_probs_triton(logits, tokens, tau):
    from .logprob_triton import token_log_probs_triton

    return token_log_probs_triton(logits, tokens, tau)


_LOG_SOFTMAX_IMPLS = {"torch": _log_softmax_torch, "triton": _log_softmax_triton}
_TOKEN_IMPLS = {"torch": _token_log_probs_torch, "triton": _token_log_probs_triton}


def log_softmax(logits: torch.Tensor, temperature, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, V] log-probs of fp32 logits [M, V] at temperature (float, or fp32 tensor [M]).
    `out`: a contiguous fp32 [M, V] tensor to write them into (inference only; the same bits); it
    may be `logits` itself (in place: every element is read before it is written)."""
    check_logits(logits)
    check_temperature(temperature, logits.shape[0], logits.device)
    check_out(out, logits.shape, torch.float32, logits.device, logits)
    backend = backend_for(logits)
    tau = temperature_column(temperature, logits.shape[0], logits.device, effective=backend == "torch")
    return _LOG_SOFTMAX_IMPLS[backend](logits, tau, out)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature) -> torch.Tensor:
    """fp32 [M]: log_softmax(logits, temperature)[m, tokens[m]], bit for bit."""
    check_logits(logits)
    check_temperature(temperature, logits.shape[0], logits.device)
    check_tokens(tokens, logits.shape[0], logits.shape[1])
    check_same_device(logits=logits, tokens=tokens)
    tau = temperature_column(temperature, logits.shape[0], logits.device)
    return _TOKEN_IMPLS[backend_for(logits)](logits, tokens, tau)


# ---------------------------------------------------------------------------------------------
# fused lm_head + log-prob (the trainer's entry point)
# ---------------------------------------------------------------------------------------------


class _LinearTokenLogProbsFunction(torch.autograd.Function):
    """Forward: per row chunk, logits = linear(h, W, fp32), then token log-probs (never [M, V] at once).

    Backward (training only; fp32 matmuls, chunk logits recomputed): with p = softmax(z / tau),
    d log p[target] / d z = (onehot(target) - p) / tau; dH = dZ @ W, dW = sum over chunks dZ^T @ H.
    """

    @staticmethod
    def forward(ctx, hidden, weight, tokens, tau, chunk_rows, blocked=None):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [M]
        for r0 in range(0, hidden.shape[0], chunk_rows):
            rows = slice(r0, r0 + chunk_rows)
            logits = mask_logits_(linear(hidden[rows], weight, out_dtype=torch.float32), blocked)  # [c, V]
            out[rows] = _TOKEN_IMPLS[backend_for(logits)](logits, tokens[rows], tau[rows])
        ctx.save_for_backward(hidden, weight, tokens, tau)
        ctx.chunk_rows, ctx.blocked = chunk_rows, blocked
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        hidden, weight, tokens, tau = ctx.saved_tensors

        def grad_logits(rows, h32, w32):
            scaled = mask_logits_(h32 @ w32.t(), ctx.blocked) / tau[rows]  # [c, V]
            grad_z = -torch.softmax(scaled, dim=-1)
            grad_z.scatter_add_(1, tokens[rows].long()[:, None], torch.ones_like(grad_z[:, :1]))
            return grad_z * (grad_out[rows].float()[:, None] / tau[rows])  # [c, V]

        grads = chunked_linear_backward(hidden, weight, ctx.chunk_rows, ctx.needs_input_grad[:2], grad_logits)
        return (*grads, None, None, None, None)


def chunked_linear_backward(hidden, weight, chunk_rows, needs, grad_logits):
    """(dH or None, dW or None) for logits z = hidden @ weight^T taken `chunk_rows` rows at a time:
    `grad_logits(rows, h32, w32)` gives dL/dz [c, V] of a chunk; dH = dZ @ W, dW = sum of dZ^T @ H
    over chunks in order (fp32 matmuls; deterministic). `needs`: (need dH, need dW)."""
    need_h, need_w = needs
    w32 = weight.float()  # [V, H]
    grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    grad_w = torch.zeros_like(w32) if need_w else None
    for r0 in range(0, hidden.shape[0], chunk_rows):
        rows = slice(r0, r0 + chunk_rows)
        h32 = hidden[rows].float()  # [c, H]
        grad_z = grad_logits(rows, h32, w32)
        if need_h:
            grad_h[rows] = grad_z @ w32
        if need_w:
            grad_w += grad_z.t() @ h32
    return (grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if need_w else None)


def _linear_token_log_probs_triton(hidden, weight, tokens, tau, chunk_rows, blocked=None):
    from .logprob_triton import linear_token_log_probs_triton

    return linear_token_log_probs_triton(hidden, weight, tokens, tau, chunk_rows, blocked)


_LINEAR_IMPLS = {"torch": _LinearTokenLogProbsFunction.apply, "triton": _linear_token_log_probs_triton}


def linear_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature,
    chunk_rows: int = 256,
    *,
    vocab_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [M] = token_log_probs(linear(hidden, weight, out_dtype=fp32), tokens, temperature), fused.

    hidden: [M, H], weight: [V, H] (one dtype, bf16/fp32), tokens: int [M], temperature: float or
    fp32 tensor [M]. Rows are processed `chunk_rows` at a time (the result does not depend on it).
    vocab_mask: optional bool [V]; ids where it is False get logit -inf before the temperature
    (logit_rules.py), so a masked token's log-prob is -inf. Differentiable w.r.t. hidden and
    weight.
    """
    check_dtype("hidden", hidden)
    check_dtype("weight", weight)
    check_dim("hidden", hidden, 2, "[M, H]")
    check_dim("weight", weight, 2, "[V, H]")
    if weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} must be [V, H] of the dtype of hidden "
            f"{tuple(hidden.shape)} {hidden.dtype}"
        )
    check_temperature(temperature, hidden.shape[0], hidden.device)
    check_tokens(tokens, hidden.shape[0], weight.shape[0])
    check_same_device(hidden=hidden, weight=weight, tokens=tokens)
    if not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    blocked = blocked_ids(vocab_mask, weight.shape[0], hidden.device)  # [V] or None
    tau = temperature_column(temperature, hidden.shape[0], hidden.device)  # [M, 1]
    return _LINEAR_IMPLS[backend_for(hidden)](hidden, weight, tokens, tau, chunk_rows, blocked)

