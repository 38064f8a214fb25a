"""`--logprobs-mode processed_logprobs` (verl's default) returns the vexact log-prob, the trainer's
value: the full-vocabulary log-softmax of the tempered logits, also when top-k narrows the draw (stock
vLLM's processed log-probs would be renormalised over the top-k tokens)."""

from __future__ import annotations

import os

import pytest
import torch

from vexact_vllm import MODEL_IMPL
from vexact_vllm.cli.rollout import Rollout
from vexact_vllm.cli.score import compare, load_trainer, trainer_log_probs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 99, 7], list(range(10, 50)), [200, 201, 202]]
TEMPERATURE = 0.7


def test_processed_logprobs_are_the_trainers(tiny_model):
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    model = tiny_model("qwen3")
    llm = LLM(model, model_impl=MODEL_IMPL, dtype="bfloat16", max_model_len=256, block_size=32,
              kv_cache_memory_bytes=64 << 20, logprobs_mode="processed_logprobs")  # fmt: skip
    try:
        params = [SamplingParams(temperature=TEMPERATURE, top_k=5, seed=i, max_tokens=10, logprobs=0,
                                 ignore_eos=True, detokenize=False) for i in range(len(PROMPTS))]  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    rollouts = []
    for ids, out in zip(PROMPTS, outputs):
        c = out.outputs[0]
        rollouts.append(Rollout(list(ids), list(c.token_ids), [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)],
                                TEMPERATURE))  # fmt: skip
    result = compare(rollouts, trainer_log_probs(load_trainer(model, torch.bfloat16), rollouts, 0))
    assert result.tokens == 30
    # a top-5 renormalised value would differ by about 3.7: the tiny model's five likeliest tokens
    # carry about 2.5% of the probability at this temperature
    assert result.mismatches == 0, result.first
