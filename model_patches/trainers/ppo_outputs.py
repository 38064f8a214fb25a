"""Per-token log-probs and entropy for RL trainers (verl's fused-kernel output contract).

log_probs: `kernels.linear_token_log_probs`, the one log-prob function the rollout uses: fp32 lm_head
logits, the optional vocabulary mask (-inf where the rollout masked them), temperature applied once
(fp32 true division), fixed-block fp32 log-softmax, gather. Bitwise the rollout's values.

entropy: H = -sum_v p_v log p_v with log p = `kernels.log_softmax` of the same masked fp32 logits at
the same temperature (masked ids have p = 0 and add nothing). Chunked over rows; the backward
recomputes each chunk: with s = z / tau, dH/ds_v = -p_v (log p_v + H), dz = dH/ds / tau (fp32
matmuls, as the log-prob backward). Entropy is not part of the contract (the rollout returns none).

Shapes: M = rows, H = hidden, V = vocabulary.
"""

from __future__ import annotations

import torch

from vexact_vllm.kernels import linear, linear_token_log_probs, log_softmax
from vexact_vllm.kernels.autograd_utils import backward_without_autocast
from vexact_vllm.kernels.sampling.logit_rules import blocked_ids, mask_logits_, temperature_column
from vexact_vllm.kernels.sampling.logprob import chunked_linear_backward

# Rows per chunk of the entropy's [rows, V] logits; only bounds memory.
ENTROPY_CHUNK_ROWS = 256


def _chunk_log_probs(hidden, weight, tau, blocked) -> torch.Tensor:
    logits = mask_logits_(linear(hidden, weight, out_dtype=torch.float32), blocked)  # [c, V]
    return log_softmax(logits, tau[:, 0])  # [c, V]


def _entropy_terms(log_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, p log p) with 0 where p == 0 (masked ids: log p = -inf)."""
    p = torch.exp(log_p)
    return p, torch.where(p > 0, p * log_p, torch.zeros_like(p))


class _LinearEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tau, blocked, chunk_rows):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [M]
        for r0 in range(0, hidden.shape[0], chunk_rows):
            rows = slice(r0, r0 + chunk_rows)
            _, p_log_p = _entropy_terms(_chunk_log_probs(hidden[rows], weight, tau[rows], blocked))
            out[rows] = -p_log_p.sum(-1)
        ctx.save_for_backward(hidden, weight, tau, out)
        ctx.blocked, ctx.chunk_rows = blocked, chunk_rows
        return out

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        hidden, weight, tau, entropy = ctx.saved_tensors

        def grad_logits(rows, h32, w32):
            log_p = _chunk_log_probs(hidden[rows], weight, tau[rows], ctx.blocked)  # [c, V]
            p, p_log_p = _entropy_terms(log_p)
            grad_z = -(p_log_p + p * entropy[rows, None])  # dH/ds [c, V]
            return grad_z * (grad_out[rows].float()[:, None] / tau[rows])

        grads = chunked_linear_backward(hidden, weight, ctx.chunk_rows, ctx.needs_input_grad[:2], grad_logits)
        return (*grads, None, None, None)


def linear_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, temperature, vocab_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [M] entropy of softmax(mask(linear(hidden, weight, fp32)) / temperature), differentiable."""
    blocked = blocked_ids(vocab_mask, weight.shape[0], hidden.device)
    tau = temperature_column(temperature, hidden.shape[0], hidden.device)  # [M, 1]
    return _LinearEntropyFunction.apply(hidden, weight, tau, blocked, ENTROPY_CHUNK_ROWS)


def token_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature,
    vocab_mask: torch.Tensor | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets) fp32 [M], entropy fp32 [M] or None); targets < 0 (ignore_index) give 0 in both."""
    valid = targets >= 0  # [M]
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    log_probs = linear_token_log_probs(hidden, weight, safe, temperature, vocab_mask=vocab_mask)
    log_probs = torch.where(valid, log_probs, torch.zeros_like(log_probs))
    if not with_entropy:
        return log_probs, None
    entropy = linear_entropy(hidden, weight, temperature, vocab_mask)
    return log_probs, torch.where(valid, entropy, torch.zeros_like(entropy))
