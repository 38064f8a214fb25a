"""The rules every log-prob and sampling path applies to fp32 logits, in one place: the temperature
rule and the vocabulary mask. logprob.py, sample.py, their Triton launchers and the trainer's PPO
entropy op (model_patches/trainers/ppo_outputs.py) all import them from here.

Temperature (`effective_temperature`, the one definition both sides use): tau == 0 means greedy and
is scored at 1; 0 < tau < MIN_TEMPERATURE (0.01) counts as 0.01, because vLLM raises such
temperatures to 0.01 before any sampler sees them (`SamplingParams.__post_init__`), so a trainer told
tau = 0.005 scores what the rollout sampled, at 0.01; any other tau is itself. The logits are
divided by it as scaled = z / tau: fp32 TRUE division by a per-row fp32 tensor, applied exactly once
(tau == 1.0 still divides, a bitwise no-op). A Python float becomes a tensor first
(`temperature_column`): dividing by a scalar may be compiled as a multiply by its reciprocal (CUDA
does), which is not the same rounding.

Vocabulary mask (`blocked_ids`, `mask_logits_`): ids where the bool [V] mask is False get logit -inf
right after the lm_head GEMM, before the temperature: exactly what verl's vLLM rollout does to the
fp32 logits our vLLM model's `compute_logits` returns (`monkey_patch_compute_logits` sets ids past
the tokenizer, and banned ids, to -inf). A -inf logit stays -inf through the division, adds
exp(-inf) = +0 to its block's sum (exact) and gets log-prob -inf and gradient 0, so both sides
normalise over the same ids and agree bitwise.
"""

import torch

# vLLM raises temperatures in (0, MIN_TEMPERATURE) to it (`vllm.sampling_params._MAX_TEMP`).
MIN_TEMPERATURE = 1e-2


def effective_temperature(tau: torch.Tensor) -> torch.Tensor:
    """The divisor for requested temperatures `tau` (fp32 tensor, any shape): 1 where tau == 0
    (greedy), MIN_TEMPERATURE where 0 < tau < MIN_TEMPERATURE (vLLM's clamp), tau elsewhere."""
    floor = torch.full_like(tau, MIN_TEMPERATURE)
    return torch.where(tau == 0, torch.ones_like(tau), torch.where(tau < MIN_TEMPERATURE, floor, tau))


def temperature_column(temperature, n_rows: int, device: torch.device, effective: bool = True) -> torch.Tensor:
    """fp32 [M, 1] divisor: `effective_temperature` of the requested temperature(s) (a float or an
    fp32 tensor [M]); with effective=False the requested values themselves (for the Triton kernels,
    which apply the rule)."""
    if isinstance(temperature, torch.Tensor):
        tau = temperature.to(device=device, dtype=torch.float32).reshape(n_rows, 1)
    else:
        tau = torch.full((n_rows, 1), float(temperature), dtype=torch.float32, device=device)
    return effective_temperature(tau) if effective else tau


def blocked_ids(vocab_mask, vocab: int, device: torch.device) -> torch.Tensor | None:
    """bool [V], True where the logit becomes -inf, from a bool [V] `vocab_mask` (True = the id may
    be produced); None when nothing is masked. ValueError for a mask of the wrong type or shape."""
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
