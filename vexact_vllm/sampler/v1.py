"""The vexact sampler of vLLM's V1 model runner (the CPU runner is a V1 runner), and its hook.

For each request row (the rules: rules.py):
1. log_probs = kernels.log_softmax(logits, tau): fp32 logits from the lm_head GEMM divided once by
   the request's temperature (tau == 0, greedy, counts as 1), then an fp32 log-softmax with a fixed
   block order. The trainer calls the same function, so the returned log-prob is its value.
2. the token: greedy rows take argmax(log_probs); the others Gumbel-max with noise keyed by
   (request seed, position of the new token, token id): the same request samples the same tokens
   alone, in any batch, after preemption or with chunked prefill. Top-k, top-p and min-p narrow
   which tokens may be drawn (`rules.truncation`), never the returned log-prob.
3. the sampled token's log-prob (and the top-k when asked) is gathered from those log-probs
   (logprobs.py: ties to the lower id, vLLM's rank).
Prompt log-probs: the V1 runner scores each prefill chunk's prompt rows with this sampler's
`compute_logprobs` (the one log-prob function at temperature 1, the trainer's
`packed_log_probs(batch, temperature=1.0)`) and `gather_logprobs` (logprobs.py), as runner v2 does
(prompt_logprobs.py).

The hook: the V1 runner builds its `Sampler` before the model exists and offers no hook to replace
it (runner v2 does: `ModelState.custom_sampler`, v2.py). So `GPUModelRunner._sample` is wrapped
(`wrap_sample`, a row of vllm_patches.py, installed in every process by `register()`): when the
runner's model is a vexact model, its sampler becomes a `VexactSampler` before the step samples.
Vexact sampling draws nothing from vLLM's per-request `torch.Generator`s (its noise is keyed by seed
and position), so the runner's generators are dropped before each step; this also keeps the V1
runner from rewinding them after a partial prefill, which CPU generators cannot do. Runners serving
any other model are left exactly as they are.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.sampler import Sampler

from vexact_vllm.kernels import log_softmax
from vexact_vllm.option_policy import refuse_request_options
from vexact_vllm.registry import is_vexact_model

from .logprobs import gather_logprobs
from .rules import GREEDY_EPS, draw_tokens, request_seed, truncation


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

    gather_logprobs = staticmethod(gather_logprobs)  # sampled and prompt tokens: logprobs.py

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
            refuse_request_options(params, use_v2_model_runner=False)  # the admission check, again
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


def wrap_sample(original):
    """`GPUModelRunner._sample` (a row of vllm_patches.py): a vexact model's runner samples with
    `VexactSampler`, without the per-request generators it does not use."""

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if not isinstance(self.sampler, VexactSampler) and is_vexact_model(self.get_model()):
            self.sampler = VexactSampler(self)
        if isinstance(self.sampler, VexactSampler):
            self.input_batch.generators.clear()
        return original(self, logits, spec_decode_metadata)

    return _sample
