"""The check's compositions without an engine: defaults per device, the shared prefix, metric
reading, a composition that tested nothing failing the verdict, and bench's table."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from vexact_vllm.cli import check
from vexact_vllm.cli.bench import to_table as bench_table
from vexact_vllm.cli.report import Row, to_json, to_table, verdict
from vexact_vllm.cli.rollout import PREFIX_CACHE_HITS, Rollout, _counter
from vexact_vllm.cli.score import compare
from vexact_vllm.tiny_model import QWEN3_1_7B_SHAPE, qwen3_shape_config


def test_default_compositions(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = check.default_compositions()
    assert "eager" not in cpu and {"alone", "batch", "prefix-cache", "chunked-prefill", "preemption"} <= set(cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check.default_compositions() == list(check.COMPOSITIONS)


def test_shared_prefix_fills_blocks(tiny_model):
    ids = check.shared_prefix(tiny_model("qwen3"), block_size=32)
    assert len(ids) >= 4 * 32 + 16
    longer = check.shared_prefix(tiny_model("qwen3"), block_size=128)  # repeated to fill 4.5 blocks
    assert len(longer) == 4 * 128 + 64 and longer[: len(ids)] == ids[: len(longer)]


def test_kv_cache_bytes(tmp_path, tiny_model):
    assert check.kv_cache_bytes(tiny_model("qwen3"), 1024) == 64 << 20
    qwen3_shape_config(QWEN3_1_7B_SHAPE, 0).save_pretrained(tmp_path)
    per_token = 2 * 28 * 8 * 128 * 2
    assert check.kv_cache_bytes(str(tmp_path), 1024) == 16 * 1024 * per_token


def test_counter_reads_metrics_defensively():
    def llm(metrics):
        return SimpleNamespace(get_metrics=lambda: metrics)

    hits = [SimpleNamespace(name=PREFIX_CACHE_HITS, value=v) for v in (5, 7)]
    assert _counter(llm(hits), PREFIX_CACHE_HITS) == 12  # summed over label sets
    assert _counter(llm([]), PREFIX_CACHE_HITS) is None
    assert _counter(llm([SimpleNamespace(name=PREFIX_CACHE_HITS)]), PREFIX_CACHE_HITS) is None

    def broken():
        raise AttributeError("no metrics here")

    assert _counter(SimpleNamespace(get_metrics=broken), PREFIX_CACHE_HITS) is None


def test_a_composition_that_tested_nothing_fails():
    rollouts = [Rollout([1, 2], [3], [-1.0])]
    exact = compare(rollouts, [torch.tensor([-1.0])])
    good = Row("batch", "vexact", "all", exact)
    empty = Row("prefix-cache (144-token prefix)", "vexact", "all", exact, {"prefix-cache hits": "0 tok"},
                problem="no prefix-cache hits: the composition tested nothing")  # fmt: skip
    assert verdict([good]) and not verdict([good, empty])
    table = to_table([good, empty])
    assert "[prefix-cache hits: 0 tok]" in table
    assert "FAIL (vexact, prefix-cache (144-token prefix)): no prefix-cache hits" in table
    assert table.endswith("FAIL: see the rows above")
    report = json.loads(to_json([good, empty], {}))
    assert report["passed"] is False and report["rows"][1]["problem"].startswith("no prefix-cache hits")


def test_check_refuses_prefix_longer_than_the_model(tiny_model):
    from vexact_vllm.cli import main

    with pytest.raises(SystemExit, match="prefix-cache composition needs"):
        main(["check", "--model", tiny_model("qwen3"), "--compositions", "prefix-cache", "--max-model-len", "200",
              "--max-tokens", "8"])  # fmt: skip


def test_bench_table_ratios():
    results = [
        {"config": "stock", "startup_s": 40.0, "output_tok_s": 20000.0},
        {"config": "stock-batch-invariant", "startup_s": 44.0, "output_tok_s": 19000.0},
        {"config": "vexact", "startup_s": 50.0, "output_tok_s": 19000.0},
    ]
    lines = bench_table(results).splitlines()
    assert lines[1].split() == ["stock", "40.0", "1.000", "20000", "1.000"]
    assert lines[2].split() == ["stock-batch-invariant", "44.0", "1.100", "19000", "0.950"]
    assert lines[3].split() == ["vexact", "50.0", "1.250", "19000", "0.950", "1.000"]
    alone = bench_table(results[2:]).splitlines()[1].split()
    assert alone == ["vexact", "50.0", "-", "19000", "-", "-"]
    failed = bench_table([{"config": "stock", "failed": "exit 1"}, results[2]]).splitlines()
    assert failed[1].split()[:3] == ["stock", "failed:", "exit"] and failed[2].split()[2] == "-"


def test_bench_default_configs(monkeypatch):
    from vexact_vllm.cli.bench import CONFIGS, DEFAULT_CONFIGS, default_configs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_configs() == ["stock", "vexact"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_configs() == list(DEFAULT_CONFIGS) == ["stock", "stock-batch-invariant", "vexact"]
    assert set(DEFAULT_CONFIGS) < set(CONFIGS)  # the A/B variants run only when named


def test_preemption_blocks_fit_the_longest_request_and_one_spare():
    from vexact_vllm.cli.rollout import RolloutSettings, preemption_blocks

    settings = RolloutSettings(model="m", max_tokens=33, block_size=32)
    prompts = [[1] * 20, [1] * 70, [1] * 5]  # 53, 103, 38 tokens at the end: 2, 4, 2 blocks
    assert preemption_blocks(prompts, settings) == 5


def test_preemption_blocks_admit_two_long_prompts_side_by_side():
    from vexact_vllm.cli.rollout import RolloutSettings, preemption_blocks

    rng = random.Random(13)
    for _ in range(50):
        bs = rng.choice([16, 32])
        settings = RolloutSettings(model="m", max_tokens=rng.randint(bs + 1, 4 * bs), block_size=bs)
        prompts = [[1] * rng.randint(1, 8000) for _ in range(rng.randint(2, 5))]
        total = preemption_blocks(prompts, settings)

        def need(tokens, bs=bs):
            return -(-tokens // bs)

        full = [need(len(p) + settings.max_tokens) for p in prompts]
        assert total > max(full)  # the longest finishes alone
        assert total >= need(len(prompts[0]) + 1) + need(len(prompts[1]) + 1)  # first two admitted together
        if max(full) + 1 < full[0] + full[1]:
            assert total < full[0] + full[1]  # ...and cannot both finish side by side
