"""Sampling options end to end with --model-impl vexact: a checkpoint whose generation_config.json
carries Qwen3's defaults (top_k 20, top_p 0.95) serves plain requests; truncated sampling draws only
inside the truncated set, the same tokens alone or in a batch, and returns the trainer's log-probs
(the full-vocabulary tempered ones); temperatures below vLLM's 0.01 floor are scored at that floor on
both sides; and on CUDA, no Triton kernel compiles while serving (vLLM's JIT monitor set to error)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from vexact_vllm import MODEL_IMPL
from vexact_vllm.cli.rollout import Rollout
from vexact_vllm.cli.score import compare, load_trainer, trainer_log_probs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 99, 7], [3] * 40, list(range(10, 70)), [200, 201], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def qwen3_with_defaults(tiny_model, tmp_path_factory):
    """The tiny Qwen3 with the sampling defaults Qwen3 checkpoints ship in generation_config.json."""
    path = tmp_path_factory.mktemp("defaults") / "qwen3"
    shutil.copytree(tiny_model("qwen3"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


def _engine(model, **kwargs):
    from vllm import LLM

    # The trainer (and the CUDA kernel tests of the same session) touch CUDA in this process: vLLM's
    # engine processes must be spawned, not forked.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    return LLM(model, model_impl=MODEL_IMPL, dtype="bfloat16", max_model_len=256, block_size=32,
               kv_cache_memory_bytes=64 << 20, **kwargs)  # fmt: skip


def _rollouts(outputs, prompts, temperature) -> list[Rollout]:
    out = []
    for ids, o in zip(prompts, outputs):
        c = o.outputs[0]
        out.append(Rollout(list(ids), list(c.token_ids), [s[t].logprob for t, s in zip(c.token_ids, c.logprobs)],
                           temperature))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def served(qwen3_with_defaults):
    """Rollouts of plain requests (the generation-config defaults) in a batch, each alone, and at a
    temperature below vLLM's floor; the engine is shut down before the trainer runs."""
    llm = _engine(qwen3_with_defaults)
    defaults = llm.get_default_sampling_params()  # what a plain request gets: the checkpoint's defaults
    assert (defaults.top_k, defaults.top_p, defaults.temperature) == (20, 0.95, 0.6)

    def params(i, **overrides):
        p = defaults.clone()
        p.seed, p.max_tokens, p.logprobs, p.ignore_eos, p.detokenize = 1000 + i, 12, 0, True, False
        for k, v in overrides.items():
            setattr(p, k, v)
        return p

    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    batch = llm.generate(prompts, [params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    alone = [llm.generate([prompts[i]], [params(i)], use_tqdm=False)[0] for i in range(len(PROMPTS))]
    cold = llm.generate(prompts, [params(i, temperature=0.005) for i in range(len(PROMPTS))], use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return {
        "batch": _rollouts(batch, PROMPTS, 0.6),
        "alone": _rollouts(alone, PROMPTS, 0.6),
        "cold": _rollouts(cold, PROMPTS, 0.005),
    }


def test_plain_requests_use_the_checkpoints_truncation_and_match_the_trainer(served, qwen3_with_defaults):
    """The trainer, told each rollout's requested temperature (0.6, or 0.005 which vLLM raised to
    0.01), returns vLLM's log-probs bit for bit."""
    trainer = load_trainer(qwen3_with_defaults, torch.bfloat16)
    for name in ("batch", "cold"):
        result = compare(served[name], trainer_log_probs(trainer, served[name], 0))
        assert result.mismatches == 0, (name, result.first)
    # every sampled token lies in the top 20 of its position's distribution (top_k = 20)
    from vexact_vllm.kernels import log_softmax

    for r in served["batch"]:
        ids = torch.tensor(r.prompt_ids + r.output_ids, device=trainer.lm_head.weight.device)
        with torch.no_grad():
            logits = trainer(ids[None]).logits[0].float()
        lp = log_softmax(logits, 0.6)[len(r.prompt_ids) - 1 : -1]  # rows predicting each output token
        chosen = lp.gather(1, torch.tensor(r.output_ids, device=lp.device)[:, None])[:, 0]
        assert bool((chosen >= lp.topk(20, dim=-1).values[:, -1]).all())


def test_truncated_sampling_is_batch_invariant(served):
    for a, b in zip(served["batch"], served["alone"]):
        assert a.output_ids == b.output_ids
        assert a.logprobs == b.logprobs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("arch", "eager"), [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_no_kernel_compiles_while_serving(tiny_model, arch, eager):
    """vLLM's JIT monitor in error mode: a Triton compilation after warm-up kills the engine."""
    from vllm import SamplingParams

    llm = _engine(tiny_model(arch), enforce_eager=eager, jit_monitor_mode="error", max_num_seqs=64)
    try:
        shapes = [[PROMPTS[0]], PROMPTS, [list(range(3, 203))] * 17, [[9] * 230]]  # 1, 5, 17 requests; long
        for i, prompts in enumerate(shapes):
            for extra in ({}, {"top_k": 5}, {"top_p": 0.8, "min_p": 0.05}, {"temperature": 0.0}):
                params = [SamplingParams(max_tokens=20, seed=j, logprobs=0, ignore_eos=True, detokenize=False,
                                         **{"temperature": 0.8, **extra}) for j in range(len(prompts))]  # fmt: skip
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == 20 for o in outs), (i, extra)
    finally:
        llm.llm_engine.engine_core.shutdown()
