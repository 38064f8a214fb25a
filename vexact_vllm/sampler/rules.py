"""The sampling rules both runners' samplers share (v1.py for the V1 runner, v2.py for runner v2).

- The greedy cut: a temperature below GREEDY_EPS (vLLM's own threshold) means greedy; the token is
  argmax(log_probs) and the log-prob is scored at temperature 1.
- The request seed: the request's own seed, else one derived from its id (`request_seed`), so the
  Gumbel noise keyed by (seed, position, token id) is the same in every process and batch.
- The draw: greedy rows take argmax(log_probs), the others Gumbel-max (`draw_tokens`), both row-wise,
  so batch-invariant.
- Truncation: top-k, top-p and min-p (from the request or the checkpoint's generation_config
  defaults) narrow only WHICH tokens Gumbel-max may draw, by a per-row log-prob threshold computed
  batch-invariantly (`kernels.sampling.truncation`); the returned log-prob stays the full-vocabulary tempered
  one, the value the trainer computes.
- Refusals: every other sampling option is classified by the allow-list of option_policy.py
  (checked at admission by request_validation.py and again per row by the V1 sampler): options that
  would change the distribution itself, or that the trainer cannot see, are refused, never ignored.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from vexact_vllm.kernels import gumbel_argmax, truncation_threshold

GREEDY_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


def request_seed(req_id: str, seed: int | None) -> int:
    """The request's own seed, else one derived from its id (stable across processes)."""
    if seed is not None:
        return int(seed)
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=7).digest(), "little")


def draw_tokens(
    log_probs: torch.Tensor,
    greedy: torch.Tensor | None,
    host_greedy: np.ndarray,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    threshold: torch.Tensor | None,
) -> torch.Tensor:
    """int64 [B]: argmax for greedy rows, truncated Gumbel-max for the others (both row-wise, so
    batch-invariant). `host_greedy` (bool [B], on the host) lets an all-greedy or all-sampled batch
    skip the other pass without a device sync; `greedy` (bool [B], on the device) is read only in a
    mixed batch (None is fine otherwise)."""
    if host_greedy.all():
        return log_probs.argmax(-1)
    sampled = gumbel_argmax(log_probs, seeds, positions, threshold)
    if not host_greedy.any():
        return sampled
    return torch.where(greedy, log_probs.argmax(-1), sampled)


def truncates(vocab: int, host_top_k, host_top_p, host_min_p) -> bool:
    """Whether any row of the batch asks for top-k (0 < k < vocab), top-p (< 1) or min-p (> 0)."""
    k_on = (host_top_k > 0) & (host_top_k < vocab)
    return bool(k_on.any() or (host_top_p < 1.0).any() or (host_min_p > 0.0).any())


def truncation(log_probs, device_rows, host_top_k, host_top_p, host_min_p) -> torch.Tensor | None:
    """The per-row threshold of `kernels.truncation_threshold` for the options that are on in this
    batch (decided from host copies: no sync), or None when no row truncates. `device_rows(name)`
    gives the device tensor of "top_k", "top_p" or "min_p" per row; it is called only for options
    that are on (a batch without truncation, the usual RL rollout, launches nothing here)."""
    vocab = log_probs.shape[1]
    if not truncates(vocab, host_top_k, host_top_p, host_min_p):
        return None
    k_on = (host_top_k > 0) & (host_top_k < vocab)
    p_on, m_on = host_top_p < 1.0, host_min_p > 0.0
    return truncation_threshold(
        log_probs,
        device_rows("top_k") if k_on.any() else None,
        device_rows("top_p") if p_on.any() else None,
        device_rows("min_p") if m_on.any() else None,
        max_top_k=int(host_top_k[k_on].max()) if k_on.any() else 0,
    )
