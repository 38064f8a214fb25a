"""Generate with vLLM under the compositions `vexact-vllm check` compares.

A composition is one way of feeding the same requests to vLLM: each prompt alone, all at once,
shuffled, a small token budget that forces chunked prefill, a KV cache small enough to force
preemption and recompute. Every request carries its own seed, so a bitwise-invariant engine returns
the same tokens and log-probs in all of them.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field


@dataclass
class Rollout:
    """One request's result: prompt and sampled tokens, and vLLM's log-prob of each sampled token."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


@dataclass
class CompositionResult:
    name: str
    rollouts: list[Rollout]
    notes: dict = field(default_factory=dict)  # e.g. {"preemptions": 3}


@dataclass
class RolloutSettings:
    model: str
    model_impl: str = "vexact"
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    max_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0
    kv_cache_bytes: int = 64 << 20
    chunk_tokens: int = 32  # max_num_batched_tokens of the chunked-prefill engine
    preempt_blocks: int = 0  # KV blocks of the preemption engine (0: sized from the requests)
    block_size: int = 32  # vLLM CPU attention needs a multiple of 32 (stock runs)
    extra: dict = field(default_factory=dict)


def sampling_params(settings: RolloutSettings, index: int):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        seed=settings.seed + index,
        logprobs=0,
        ignore_eos=True,
    )


def _engine(settings: RolloutSettings, **overrides):
    from vllm import LLM

    kwargs = dict(
        model=settings.model,
        model_impl=settings.model_impl,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        kv_cache_memory_bytes=settings.kv_cache_bytes,
        block_size=settings.block_size,
        disable_log_stats=False,
        enable_prefix_caching=True,
    )
    kwargs.update(settings.extra)
    kwargs.update(overrides)
    return LLM(**kwargs)


def _shutdown(llm) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def _generate(llm, prompt_ids: list[list[int]], settings: RolloutSettings, order: list[int]) -> dict[int, Rollout]:
    """Submit requests `order` (indices into prompt_ids) in one call; results keyed by index."""
    prompts = [{"prompt_token_ids": prompt_ids[i]} for i in order]
    params = [sampling_params(settings, i) for i in order]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {}
    for i, out in zip(order, outputs):
        completion = out.outputs[0]
        logprobs = [step[tok].logprob for tok, step in zip(completion.token_ids, completion.logprobs)]
        result[i] = Rollout(list(prompt_ids[i]), list(completion.token_ids), logprobs)
    return result


def _generate_all(llm, prompt_ids, settings, order) -> list[Rollout]:
    by_index = _generate(llm, prompt_ids, settings, order)
    return [by_index[i] for i in range(len(prompt_ids))]


def _preemptions(llm) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            return int(getattr(metric, "value", 0))
    return 0


def run_compositions(
    prompt_ids: list[list[int]], settings: RolloutSettings, names: list[str], progress=None
) -> list[CompositionResult]:
    """Run the named compositions; engines are started once each and shut down after use."""
    results: list[CompositionResult] = []
    n = len(prompt_ids)
    step = progress.update if progress is not None else (lambda *_: None)

    if {"alone", "batch", "shuffled"} & set(names):
        llm = _engine(settings)
        try:
            if "alone" in names:
                rollouts = [_generate(llm, prompt_ids, settings, [i])[i] for i in range(n)]
                results.append(CompositionResult("alone", rollouts))
                step(1)
            if "batch" in names:
                results.append(CompositionResult("batch", _generate_all(llm, prompt_ids, settings, list(range(n)))))
                step(1)
            if "shuffled" in names:
                order = list(range(n))
                random.Random(settings.seed).shuffle(order)
                results.append(CompositionResult("shuffled", _generate_all(llm, prompt_ids, settings, order)))
                step(1)
        finally:
            _shutdown(llm)

    if "chunked-prefill" in names:
        llm = _engine(
            settings,
            enable_chunked_prefill=True,
            max_num_batched_tokens=settings.chunk_tokens,
            max_num_seqs=max(2, min(n, settings.chunk_tokens)),
        )
        try:
            rollouts = _generate_all(llm, prompt_ids, settings, list(range(n)))
            results.append(CompositionResult(f"chunked-prefill ({settings.chunk_tokens} tok)", rollouts))
            step(1)
        finally:
            _shutdown(llm)

    if "preemption" in names:
        blocks = settings.preempt_blocks or preemption_blocks(prompt_ids, settings)
        llm = _engine(settings, num_gpu_blocks_override=blocks, max_model_len=(blocks - 1) * settings.block_size)
        try:
            rollouts = _generate_all(llm, prompt_ids, settings, list(range(n)))
            results.append(
                CompositionResult(f"preemption ({blocks} blocks)", rollouts, {"preemptions": _preemptions(llm)})
            )
            step(1)
        finally:
            _shutdown(llm)
    return results


def preemption_blocks(prompt_ids: list[list[int]], settings: RolloutSettings) -> int:
    """Enough blocks for the longest request to finish alone, too few for all of them at once."""
    per_request = [-(-(len(p) + settings.max_tokens) // settings.block_size) for p in prompt_ids]
    return max(max(per_request) + 2, sum(per_request) // 3)
