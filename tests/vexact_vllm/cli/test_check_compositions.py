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
from vexact_vllm.cli.rollout import PREFIX_CACHE_HITS, Rollout, metric_counter
from vexact_vllm.cli.score import compare
from vexact_vllm.model_shapes import QWEN3_1_7B_SHAPE
from vexact_vllm.tiny_model import qwen3_shape_config


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
    assert metric_counter(llm(hits), PREFIX_CACHE_HITS) == 12  # summed over label sets
    assert metric_counter(llm([]), PREFIX_CACHE_HITS) is None
    assert metric_counter(llm([SimpleNamespace(name=PREFIX_CACHE_HITS)]), PREFIX_CACHE_HITS) is None

    def broken():
        raise AttributeError("no metrics here")

    assert metric_counter(SimpleNamespace(get_metrics=broken), PREFIX_CACHE_HITS) is None


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


def test_preemption_plan_fits_the_longest_request_and_puts_it_first():
    from vexact_vllm.cli.rollout import RolloutSettings, preemption_plan

    settings = RolloutSettings(model="m", max_tokens=33, block_size=32)
    prompts = [[1] * 20, [2] * 70, [3] * 5]  # 53, 103, 38 tokens at the end: 2, 4, 2 blocks
    # A = request 1 (4 blocks), B = request 0 (admitted beside it: 3 + 1 blocks); 4 usable + the null block
    assert preemption_plan(prompts, settings) == (5, [1, 0, 2])


def test_shared_blocks_count_whole_common_blocks_but_not_the_last_prompt_token():
    from vexact_vllm.cli.rollout import shared_blocks

    assert shared_blocks([1] * 64, [1] * 64, 32) == 1  # vLLM computes the last token: its block is not hit
    assert shared_blocks([1] * 64, [1] * 65, 32) == 2
    assert shared_blocks([1] * 64, [1] * 40 + [2] * 40, 32) == 1
    assert shared_blocks([2] + [1] * 99, [1] * 100, 32) == 0
    assert shared_blocks([1] * 10, [1] * 10, 32) == 0


def _need(tokens, bs):
    return -(-tokens // bs)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_plan_forces_two_requests_to_collide(caching):
    """For random prompts, some sharing prefixes (one repeated, a common system prompt): every request
    fits alone; the first two are admitted side by side and cannot both run to the first's end."""
    from vexact_vllm.cli.rollout import RolloutSettings, preemption_plan, shared_blocks

    for case in range(300):  # case i draws from random.Random(i): a failing case names its seed
        rng = random.Random(case)
        bs = rng.choice([16, 32, 64])
        settings = RolloutSettings(model="m", max_tokens=rng.randint(bs + 1, 4 * bs), block_size=bs,
                                   extra={} if caching else {"enable_prefix_caching": False})  # fmt: skip
        system = [rng.randrange(1000) for _ in range(rng.choice([0, 0, 5, bs, 3 * bs + 7]))]
        prompts = [system + [rng.randrange(1000) for _ in range(rng.randint(1, 2000))] for _ in range(rng.randint(2, 6))]
        if rng.random() < 0.3:
            prompts.append(list(prompts[0]))  # a prompt repeated (a prompts file used in turn)
        blocks, order = preemption_plan(prompts, settings)
        usable = blocks - 1  # vLLM's null block
        a, b = order[:2]
        assert sorted(order) == list(range(len(prompts))), f"seed {case}"
        full = [_need(len(p) + settings.max_tokens, bs) for p in prompts]
        assert usable >= max(full) == full[a], f"seed {case}"  # every request finishes alone; A is the longest
        shared = shared_blocks(prompts[a], prompts[b], bs) if caching else 0
        together = _need(len(prompts[a]) + 1, bs) + _need(len(prompts[b]) + 1, bs) - shared
        assert usable >= together, f"seed {case}"  # admitted together
        assert full[a] + _need(len(prompts[b]) + 1, bs) - shared > usable, f"seed {case}"  # ...cannot both run to A's end
        if caching and any(shared_blocks(prompts[a], p, bs) == 0 for i, p in enumerate(prompts) if i != a):
            assert shared == 0, f"seed {case}"  # B's admission does not hang on a cache hit when it can be avoided


def test_preemption_plan_counts_a_hybrid_models_state_blocks():
    """A hybrid model's requests hold state blocks beside their attention blocks (hybrid_blocks.py): for
    random geometries and prompts, the plan still fits every request alone, admits the first two side
    by side and leaves no room for both to reach the first's end."""
    from vexact_vllm.cli.hybrid_blocks import HybridBlocks
    from vexact_vllm.cli.rollout import RolloutSettings, preemption_plan

    for case in range(300):
        rng = random.Random(case)
        hybrid = HybridBlocks(64 * rng.randint(1, 8), rng.randint(1, 3), rng.randint(1, 4))
        bs = hybrid.block_size
        settings = RolloutSettings(model="m", max_tokens=rng.randint(bs + 1, 3 * bs), block_size=bs,
                                   extra={"enable_prefix_caching": False})  # fmt: skip
        prompts = [[rng.randrange(1000) for _ in range(rng.randint(1, 3000))] for _ in range(rng.randint(2, 6))]
        blocks, order = preemption_plan(prompts, settings, hybrid)
        usable, (a, b) = blocks - 1, order[:2]
        need = hybrid.request_blocks
        full = [need(len(p) + settings.max_tokens) for p in prompts]
        assert usable >= max(full) == full[a], f"seed {case}"
        assert usable >= need(len(prompts[a]) + 1) + need(len(prompts[b]) + 1), f"seed {case}"
        assert full[a] + need(len(prompts[b]) + 1) > usable, f"seed {case}"


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_block_size_is_the_least_multiple_of_64_holding_a_state_page(tiny_model, arch):
    import math

    from transformers import AutoConfig

    from vexact_vllm.cli.hybrid_blocks import hybrid_blocks
    from vexact_vllm.model_patches.config import DecoderConfig
    from vexact_vllm.model_patches.gated_delta import state_dtypes, state_shapes

    path = tiny_model(arch)
    config = DecoderConfig.from_hf(AutoConfig.from_pretrained(path))
    for tp in (1, 2):
        geometry = hybrid_blocks(path, "bfloat16", tp, least=32)
        page = sum(math.prod(s) * d.itemsize for s, d in zip(state_shapes(config.linear.shard(tp)),
                                                                 state_dtypes(torch.bfloat16), strict=True))  # fmt: skip
        per_token = 2 * max(config.num_kv_heads // tp, 1) * config.head_dim * 2
        assert geometry.block_size % 64 == 0
        assert geometry.block_size * per_token >= page > (geometry.block_size - 64) * per_token
        assert geometry.attention_groups >= 1 and geometry.state_groups >= 1
    assert hybrid_blocks(tiny_model("qwen3"), "bfloat16") is None
