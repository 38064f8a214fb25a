"""The vexact sampler: log-probs from the one log-prob function, order-free seeded sampling.

Replaces vLLM's sampler for vexact models (installed by `runner_hooks`). For each request row:
1. log_probs = kernels.log_softmax(logits, tau): fp32 logits from the lm_head GEMM divided once by
   the request's temperature (tau == 0, greedy, counts as 1), then an fp32 log-softmax with a fixed
   block order. The trainer calls the same function, so the returned log-prob is its value.
2. the token: greedy rows take argmax(log_probs); the others Gumbel-max with noise keyed by
   (request seed, position of the new token, token id): the same request samples the same tokens
   alone, in any batch, after preemption or with chunked prefill.
3. the sampled token's log-prob (and the top-k when asked) is gathered from those log-probs.

Sampling options that would change the distribution the trainer cannot see (top-k, top-p, min-p,
penalties, logit bias, bad words, allowed token ids, min_tokens) are refused, never ignored.
"""

from __future__ import annotations

import hashlib

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.sampler import Sampler

from vexact_vllm.kernels import gumbel_argmax, log_softmax

GREEDY_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy


def request_seed(req_id: str, seed: int | None) -> int:
    """The request's own seed, else one derived from its id (stable across processes)."""
    if seed is not None:
        return int(seed)
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=7).digest(), "little")


def refuse_unsupported(params) -> None:
    """Raise for sampling options the bitwise contract cannot keep."""
    checks = {
        "top_k": params.top_k not in (None, 0, -1),
        "top_p": params.top_p is not None and params.top_p < 1.0,
        "min_p": bool(params.min_p),
        "presence_penalty": bool(params.presence_penalty),
        "frequency_penalty": bool(params.frequency_penalty),
        "repetition_penalty": params.repetition_penalty not in (None, 1.0),
        "logit_bias": bool(params.logit_bias),
        "bad_words": bool(params.bad_words),
        "allowed_token_ids": bool(params.allowed_token_ids),
        "min_tokens": bool(params.min_tokens),
    }
    bad = [name for name, on in checks.items() if on]
    if bad:
        raise ValueError(
            f"sampling options {', '.join(bad)} are not supported with --model-impl vexact: they change "
            "the sampling distribution that the trainer's log-probs describe; drop them from the request"
        )


class VexactSampler(Sampler):
    """Reads seeds and positions from the model runner that owns it (V1 runner)."""

    def __init__(self, runner):
        super().__init__(logprobs_mode="raw_logprobs")
        self.runner = runner

    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:  # prompt log-probs: temperature 1
        return log_softmax(logits.float(), 1.0)

    def _rows(self, num_rows: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, seed, position, greedy) per row; warm-up rows (no request) are greedy."""
        batch = self.runner.input_batch
        temps, seeds, positions = [1.0] * num_rows, [0] * num_rows, [0] * num_rows
        seq_lens = self.runner.seq_lens[:num_rows].tolist()
        greedy = [True] * num_rows
        for i, req_id in enumerate(batch.req_ids[:num_rows]):
            state = self.runner.requests.get(req_id)
            if state is None or state.sampling_params is None:
                continue
            params = state.sampling_params
            refuse_unsupported(params)
            greedy[i] = params.temperature < GREEDY_EPS
            temps[i] = 1.0 if greedy[i] else float(params.temperature)
            seeds[i] = request_seed(req_id, params.seed)
            positions[i] = seq_lens[i]  # index of the token being sampled
        as_tensor = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        return (
            as_tensor(temps, torch.float32),
            as_tensor(seeds, torch.int64),
            as_tensor(positions, torch.int64),
            as_tensor(greedy, torch.bool),
        )

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        if predict_bonus_token:
            raise ValueError("speculative decoding is not supported with --model-impl vexact")
        temps, seeds, positions, greedy = self._rows(logits.shape[0], logits.device)
        log_probs = log_softmax(logits.float(), temps)  # [B, V] fp32
        sampled = torch.where(greedy, log_probs.argmax(-1), gumbel_argmax(log_probs, seeds, positions))
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            k = sampling_metadata.max_num_logprobs
            if k == -1:
                k = log_probs.shape[-1]
            logprobs_tensors = self.gather_logprobs(log_probs, k, token_ids=sampled.long())
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1), logprobs_tensors=logprobs_tensors)
