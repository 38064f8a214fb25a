"""THE log-prob function, shared by the sampler (inference) and the trainer, and Gumbel-max sampling.

Temperature semantics (defined here once; every caller goes through these functions):
* logits z are fp32: the lm_head is `linear(hidden, weight, out_dtype=torch.float32)`.
* the effective temperature (`effective_temperature`, the one definition both sides use): tau == 0
  means greedy and is scored at 1; 0 < tau < MIN_TEMPERATURE (0.01) counts as 0.01, because vLLM
  raises such temperatures to 0.01 before any sampler sees them (`SamplingParams.__post_init__`), so
  a trainer told tau = 0.005 scores what the rollout sampled, at 0.01; any other tau is itself.
* scaled = z / tau: fp32 TRUE division by a per-row fp32 tensor, applied exactly once (tau == 1.0
  still divides, a bitwise no-op). A Python float becomes a tensor first: dividing by a scalar may
  be compiled as a multiply by its reciprocal (CUDA does), which is not the same rounding.

Vocabulary mask (`linear_token_log_probs(..., vocab_mask=)`): ids where the bool [V] mask is False
get logit -inf right after the lm_head GEMM, before the temperature: exactly what verl's vLLM rollout
does to the fp32 logits our vLLM model's `compute_logits` returns (`monkey_patch_compute_logits`
sets ids past the tokenizer, and banned ids, to -inf). A -inf logit stays -inf through the division,
adds exp(-inf) = +0 to its block's sum (exact) and gets log-prob -inf and gradient 0, so both sides
normalise over the same ids and agree bitwise.

Log-softmax, per row of V scaled logits:
    mx  = max_v scaled[v]                                        exact, order-free
    e   = exp(scaled - mx), zero-padded to a multiple of VOCAB_BLOCK = 1024
    sum = ((b_0 + b_1) + b_2) + ...,  b_i = sum of e over block i  (1024-long sums, then in order)
    lse = mx + log(sum);  log_probs = scaled - lse
Invariant: every sum has a fixed length (1024, then the blocks one by one in index order) and
everything else is elementwise, so a row's log-probs are the same bits alone or in any batch, and
`linear_token_log_probs` (fused, chunked over rows, the trainer's entry point) equals
`token_log_probs(linear(...))` bit for bit.

Gumbel-max sampling: token = argmax_v(log_probs[v] + g_v), with g_v = -log(-log(u_v)) in fp32 and
u_v a function of (seed, position, v) only, by a counter-based hash (int64 torch ops, masked):
    mix(x)   = splitmix64's finalizer on 63 bits: x ^= x >> 30; x *= C1; x ^= x >> 27; x *= C2;
               x ^= x >> 31, each product wrapped mod 2^64 then masked to 63 bits
    key      = mix(mix(seed ^ GOLDEN) ^ position) mod 2^32       once per row (seed, position on 63 bits)
    hash(x)  = a 32-bit finalizer ("lowbias32"): x ^= x >> 16; x *= H1; x ^= x >> 15; x *= H2;
               x ^= x >> 16, each product wrapped mod 2^32 (a bijection of 32-bit words)
    h        = hash(key ^ v)                                      per token id, 32-bit arithmetic only
    u        = ((h >> 9) + 0.5) / 2^23                            top 23 bits: exact in fp32, in (0, 1)
So a request samples the same tokens alone or in any batch, in any order. The per-id hash is 32-bit
because it runs V times a row (the CUDA kernel's cost was its 64-bit products); the row key keeps
splitmix64's 63 bits of seed and position.
"""

import torch
import torch.nn.functional as F

from .autograd_utils import backward_without_autocast
from .checks import (
    check_dim,
    check_dtype,
    check_int,
    check_last_dim_contiguous,
    check_out,
    check_same_device,
)
from .dispatch import backend_for
from .gemm import linear
from .reduction import row_sum, sequential_sum

# Vocabulary entries per block of the exp-sum. Fixed: it sets the order of the additions.
VOCAB_BLOCK = 1024
# vLLM raises temperatures in (0, MIN_TEMPERATURE) to it (`vllm.sampling_params._MAX_TEMP`).
MIN_TEMPERATURE = 1e-2

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15 & _MASK63
# splitmix64 multipliers as signed int64 (same low 64 bits): torch has no uint64 arithmetic.
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_C2 = 0x94D049BB133111EB - (1 << 64)
# The per-id 32-bit hash (lowbias32's multipliers) and its mask.
_MASK32 = (1 << 32) - 1
_H1 = 0x7FEB352D
_H2 = 0x846CA68B
_UNIFORM_BITS = 23
# Rows per chunk of the [rows, V] hash in gumbel_argmax; only bounds memory.
_GUMBEL_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------------------------
# log-softmax
# ---------------------------------------------------------------------------------------------


def effective_temperature(tau: torch.Tensor) -> torch.Tensor:
    """The divisor for requested temperatures `tau` (fp32 tensor, any shape): 1 where tau == 0
    (greedy), MIN_TEMPERATURE where 0 < tau < MIN_TEMPERATURE (vLLM's clamp), tau elsewhere."""
    floor = torch.full_like(tau, MIN_TEMPERATURE)
    return torch.where(tau == 0, torch.ones_like(tau), torch.where(tau < MIN_TEMPERATURE, floor, tau))


def _temperature_column(temperature, n_rows: int, device: torch.device, effective: bool = True) -> torch.Tensor:
    """fp32 [M, 1] divisor: `effective_temperature` of the requested temperature(s); with
    effective=False the requested values themselves (for the Triton kernels, which apply the rule)."""
    if isinstance(temperature, torch.Tensor):
        tau = temperature.to(device=device, dtype=torch.float32).reshape(n_rows, 1)
    else:
        tau = torch.full((n_rows, 1), float(temperature), dtype=torch.float32, device=device)
    return effective_temperature(tau) if effective else tau


def _scaled_and_lse(logits: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [M, V] = logits / tau and its row logsumexp [M] in the fixed block order."""
    n_rows, vocab = logits.shape
    scaled = logits / tau  # [M, V]
    mx = scaled.amax(-1, keepdim=True).detach()  # [M, 1]; detached: logsumexp is shift-invariant
    e = torch.exp(scaled - mx)  # [M, V]
    pad = (-vocab) % VOCAB_BLOCK
    if pad:
        e = F.pad(e, (0, pad))  # [M, nb * 1024]
    block_sums = row_sum(e.reshape(n_rows, e.shape[1] // VOCAB_BLOCK, VOCAB_BLOCK))  # [M, nb]
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


def _check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    check_dtype(name, logits, (torch.float32,))
    check_dim(name, logits, 2, "[M, V]")
    if logits.shape[1] == 0:
        raise ValueError(f"{name} must have a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    check_last_dim_contiguous(name, logits)


def _check_temperature(temperature, n_rows: int, device: torch.device) -> None:
    if isinstance(temperature, torch.Tensor):
        check_dtype("temperature", temperature, (torch.float32,))
        if temperature.numel() != n_rows or temperature.dim() > 1:
            raise ValueError(
                f"temperature must be a float or an fp32 tensor [{n_rows}], got {tuple(temperature.shape)}"
            )
        if temperature.device != device:
            raise ValueError(f"temperature is on {temperature.device}, logits on {device}")
        # Values are checked on the CPU only: on CUDA the check would stall the sampler on a host
        # sync every step (vLLM has validated each request's temperature at admission).
        if temperature.device.type == "cpu" and (
            bool((temperature < 0).any()) or not bool(torch.isfinite(temperature).all())
        ):
            raise ValueError("temperature must be finite and >= 0 (0 means greedy)")
    elif not isinstance(temperature, (int, float)) or not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")


def _check_tokens(tokens: torch.Tensor, n_rows: int, vocab: int) -> None:
    check_int("tokens", tokens)
    if tuple(tokens.shape) != (n_rows,):
        raise ValueError(f"tokens must have shape ({n_rows},), got {tuple(tokens.shape)}")
    if n_rows and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"tokens must lie in [0, {vocab})")


def _blocked_ids(vocab_mask, vocab: int, device: torch.device) -> torch.Tensor | None:
    """bool [V], True where the logit becomes -inf; None when nothing is masked."""
    if vocab_mask is None:
        return None
    if not isinstance(vocab_mask, torch.Tensor) or vocab_mask.dtype != torch.bool:
        raise ValueError(f"vocab_mask must be a bool tensor [{vocab}] (True = the id may be produced)")
    if tuple(vocab_mask.shape) != (vocab,):
        raise ValueError(f"vocab_mask must have shape ({vocab},), got {tuple(vocab_mask.shape)}")
    if vocab_mask.device != device:
        raise ValueError(f"vocab_mask is on {vocab_mask.device}, hidden on {device}")
    return ~vocab_mask


def mask_logits_(logits: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """Set logits[:, v] = -inf where blocked[v] (in place; the rollout side's vocabulary masking)."""
    if blocked is not None:
        logits.masked_fill_(blocked, float("-inf"))
    return logits


def log_softmax(logits: torch.Tensor, temperature, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, V] log-probs of fp32 logits [M, V] at temperature (float, or fp32 tensor [M]).
    `out`: a contiguous fp32 [M, V] tensor to write them into (inference only; the same bits); it
    may be `logits` itself (in place: every element is read before it is written)."""
    _check_logits(logits)
    _check_temperature(temperature, logits.shape[0], logits.device)
    check_out(out, logits.shape, torch.float32, logits.device, logits)
    backend = backend_for(logits)
    tau = _temperature_column(temperature, logits.shape[0], logits.device, effective=backend == "torch")
    return _LOG_SOFTMAX_IMPLS[backend](logits, tau, out)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature) -> torch.Tensor:
    """fp32 [M]: log_softmax(logits, temperature)[m, tokens[m]], bit for bit."""
    _check_logits(logits)
    _check_temperature(temperature, logits.shape[0], logits.device)
    _check_tokens(tokens, logits.shape[0], logits.shape[1])
    check_same_device(logits=logits, tokens=tokens)
    tau = _temperature_column(temperature, logits.shape[0], logits.device)
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
    vocab_mask: optional bool [V]; ids where it is False get logit -inf before the temperature (see
    the module docstring), so a masked token's log-prob is -inf. Differentiable w.r.t. hidden and
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
    _check_temperature(temperature, hidden.shape[0], hidden.device)
    _check_tokens(tokens, hidden.shape[0], weight.shape[0])
    check_same_device(hidden=hidden, weight=weight, tokens=tokens)
    if not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    blocked = _blocked_ids(vocab_mask, weight.shape[0], hidden.device)  # [V] or None
    tau = _temperature_column(temperature, hidden.shape[0], hidden.device)  # [M, 1]
    return _LINEAR_IMPLS[backend_for(hidden)](hidden, weight, tokens, tau, chunk_rows, blocked)


# ---------------------------------------------------------------------------------------------
# Gumbel-max sampling
# ---------------------------------------------------------------------------------------------


def _mix63(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer kept on 63 bits; x: int64 in [0, 2^63), so `>>` is a logical shift."""
    x = ((x ^ (x >> 30)) * _C1) & _MASK63
    x = ((x ^ (x >> 27)) * _C2) & _MASK63
    return x ^ (x >> 31)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """The per-id 32-bit finalizer; x: int64 in [0, 2^32): products wrap mod 2^64, masked to 32 bits."""
    x = ((x ^ (x >> 16)) * _H1) & _MASK32
    x = ((x ^ (x >> 15)) * _H2) & _MASK32
    return x ^ (x >> 16)


def gumbel_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [M, V] uniforms in (0, 1) keyed by (seeds[m], positions[m], v) only: the hash's u."""
    row_key = _mix63(_mix63((seeds.long() & _MASK63) ^ _GOLDEN) ^ (positions.long() & _MASK63)) & _MASK32
    token_ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)  # [V]
    h = _hash32(row_key[:, None] ^ token_ids[None, :])  # [M, V]
    return ((h >> (32 - _UNIFORM_BITS)).float() + 0.5) * (2.0**-_UNIFORM_BITS)  # exact, in (0, 1)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [M, V] Gumbel noise keyed by (seeds[m], positions[m], v) only."""
    return -torch.log(-torch.log(gumbel_uniform(seeds, positions, vocab)))


def _gumbel_argmax_torch(log_probs, seeds, positions, threshold=None, out=None):
    n_rows, vocab = log_probs.shape
    step = max(1, _GUMBEL_ELEMENTS // max(vocab, 1))
    out = torch.empty(n_rows, dtype=torch.int64, device=log_probs.device) if out is None else out
    for r0 in range(0, n_rows, step):
        rows = slice(r0, r0 + step)
        lp = log_probs[rows]
        if threshold is not None:  # truncated sampling: ids below the row's threshold cannot win
            lp = torch.where(lp >= threshold[rows, None], lp, float("-inf"))
        out[rows] = (lp + gumbel_noise(seeds[rows], positions[rows], vocab)).argmax(-1)
    return out


def _gumbel_argmax_triton(log_probs, seeds, positions, threshold=None, out=None):
    from .gumbel_triton import gumbel_argmax_triton  # imported on first use: no Triton on CPU

    return gumbel_argmax_triton(log_probs, seeds, positions, threshold, out=out)


_GUMBEL_IMPLS = {"torch": _gumbel_argmax_torch, "triton": _gumbel_argmax_triton}


def _check_noise_keys(seeds: torch.Tensor, positions: torch.Tensor, n_rows: int) -> None:
    """The Gumbel noise's key: int tensors [M] of seeds and positions."""
    for name, t in (("seeds", seeds), ("positions", positions)):
        check_int(name, t)
        if tuple(t.shape) != (n_rows,):
            raise ValueError(f"{name} must have shape ({n_rows},), got {tuple(t.shape)}")


def gumbel_argmax(
    log_probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    threshold: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [M]: argmax_v(log_probs[m, v] + gumbel(seeds[m], positions[m], v)) over the ids with
    log_probs[m, v] >= threshold[m] (all of them without a threshold); written into `out` (a
    contiguous int64 [M]) when given.

    log_probs: fp32 [M, V] (already at the request's temperature; greedy rows should take
    log_probs.argmax(-1) instead); seeds, positions: int64 [M]; threshold: fp32 [M] or None
    (`kernels.truncation.truncation_threshold`: top-k, top-p, min-p). Ties go to the lowest token id.
    """
    _check_logits(log_probs, "log_probs")
    _check_noise_keys(seeds, positions, log_probs.shape[0])
    if threshold is not None:
        check_dtype("threshold", threshold, (torch.float32,))
        if tuple(threshold.shape) != (log_probs.shape[0],):
            raise ValueError(f"threshold must have shape ({log_probs.shape[0]},), got {tuple(threshold.shape)}")
    check_same_device(log_probs=log_probs, seeds=seeds, positions=positions, threshold=threshold)
    check_out(out, (log_probs.shape[0],), torch.int64, log_probs.device)
    return _GUMBEL_IMPLS[backend_for(log_probs)](log_probs, seeds, positions, threshold, out)
