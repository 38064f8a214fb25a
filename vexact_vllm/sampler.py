"""The vexact sampler: log-probs from the one log-prob function, order-free seeded sampling.

Replaces vLLM's sampler for vexact models (installed by `runner_hooks`). For each request row:
1. log_probs = kernels.log_softmax(logits, tau): fp32 logits from the lm_head GEMM divided once by
   the request's temperature (tau == 0, greedy, counts as 1), then an fp32 log-softmax with a fixed
   block order. The trainer calls the same function, so the returned log-prob is its value.
2. the token: greedy rows take argmax(log_probs); the others Gumbel-max with noise keyed by
   (request seed, position of the new token, token id): the same request samples the same tokens
   alone, in any batch, after preemption or with chunked prefill.
3. the sampled token's log-prob (and the top-k when asked) is gathered from those log-probs.

Truncated sampling (top-k, top-p, min-p, from the request or the checkpoint's generation_config
defaults) narrows only WHICH tokens Gumbel-max may draw, by a per-row log-prob threshold computed
batch-invariantly (`kernels.truncation`); the returned log-prob is still the full-vocabulary
tempered one above, the value the trainer computes. Options that would change the distribution
itself, or that the trainer cannot see (penalties, logit bias, bad words, allowed token ids,
min_tokens, structured outputs / guided decoding), are refused, never ignored (`refuse_unsupported`).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.sampler import Sampler

from vexact_vllm.kernels import gumbel_argmax, log_softmax, truncation_threshold

GREEDY_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


def request_seed(req_id: str, seed: int | None) -> int:
    """The request's own seed, else one derived from its id (stable across processes)."""
    if seed is not None:
        return int(seed)
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=7).digest(), "little")


def refuse_unsupported(params) -> None:
    """Raise for sampling options the bitwise contract cannot keep (top-k, top-p, min-p are kept:
    see the module docstring)."""
    checks = {
        "presence_penalty": bool(params.presence_penalty),
        "frequency_penalty": bool(params.frequency_penalty),
        "repetition_penalty": params.repetition_penalty not in (None, 1.0),
        "logit_bias": bool(params.logit_bias),
        "bad_words": bool(params.bad_words),
        "allowed_token_ids": bool(params.allowed_token_ids),
        "min_tokens": bool(params.min_tokens),
        "structured_outputs (guided decoding, response_format)": getattr(params, "structured_outputs", None)
        is not None,
    }
    bad = [name for name, on in checks.items() if on]
    if bad:
        raise ValueError(
            f"sampling options {', '.join(bad)} are not supported with --model-impl vexact: they change "
            "the sampling distribution that the trainer's log-probs describe; drop them from the request "
            "(temperature, seed, top_k, top_p and min_p are supported)"
        )


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


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the GPU: a copy from pageable memory would be
    synchronous (it waits for every kernel queued before it); from torch's caching pinned allocator
    it is asynchronous, and the allocator keeps the block until the copy has run."""
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class VexactSampler(Sampler):
    """Reads seeds and positions from the model runner that owns it (V1 runner)."""

    def __init__(self, runner):
        super().__init__(logprobs_mode="raw_logprobs")
        self.runner = runner

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:  # prompt log-probs: temperature 1
        return log_softmax(logits.float(), 1.0)

    def _rows(self, num_rows: int) -> dict[str, np.ndarray]:
        """Per row (host arrays): temperature, seed, greedy, top_k, top_p, min_p; warm-up rows (no
        request) are greedy. (The position of the token being sampled is the runner's device
        `seq_lens`, read on the device in `forward`: reading it here would wait for the GPU.)"""
        batch = self.runner.input_batch
        rows = {
            "temperature": np.ones(num_rows, np.float32), "seed": np.zeros(num_rows, np.int64),
            "greedy": np.ones(num_rows, bool), "top_k": np.zeros(num_rows, np.int64),
            "top_p": np.ones(num_rows, np.float32), "min_p": np.zeros(num_rows, np.float32),
        }  # fmt: skip
        for i, req_id in enumerate(batch.req_ids[:num_rows]):
            state = self.runner.requests.get(req_id)
            if state is None or state.sampling_params is None:
                continue
            params = state.sampling_params
            refuse_unsupported(params)
            greedy = params.temperature < GREEDY_EPS
            rows["greedy"][i] = greedy
            rows["temperature"][i] = 1.0 if greedy else params.temperature
            rows["seed"][i] = request_seed(req_id, params.seed)
            rows["top_k"][i] = params.top_k or 0
            rows["top_p"][i] = 1.0 if params.top_p is None else params.top_p
            rows["min_p"][i] = params.min_p or 0.0
        return rows

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        if predict_bonus_token:
            raise ValueError("speculative decoding is not supported with --model-impl vexact")
        rows = self._rows(logits.shape[0])
        dev = {k: to_device(v, logits.device) for k, v in rows.items()}
        # index of the token being sampled (its Gumbel noise key), on the device: no host sync
        dev["position"] = self.runner.seq_lens[: logits.shape[0]].to(device=logits.device, dtype=torch.int64)
        log_probs = log_softmax(logits.float(), dev["temperature"])  # [B, V] fp32
        threshold = truncation(log_probs, dev.__getitem__, rows["top_k"], rows["top_p"], rows["min_p"])
        sampled = draw_tokens(log_probs, dev["greedy"], rows["greedy"], dev["seed"], dev["position"], threshold)
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            k = sampling_metadata.max_num_logprobs
            if k == -1:
                k = log_probs.shape[-1]
            logprobs_tensors = self.gather_logprobs(log_probs, k, token_ids=sampled.long())
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1), logprobs_tensors=logprobs_tensors)
