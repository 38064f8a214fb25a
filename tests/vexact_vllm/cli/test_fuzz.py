"""`vexact-vllm fuzz`: cases are reproducible and within the kernels' limits, the report counts every
failure per composition with a command that rebuilds the case; hybrid configs are valid without an engine;
one CPU case end to end (CI's bound), a Gated DeltaNet hybrid: the engine rules and the families without
Gated DeltaNet layers are those the rest of the CLI tests run."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from vexact_vllm.cli.fuzz import reproducer, summary, to_table
from vexact_vllm.cli.fuzz_cases import HYBRIDS, PROFILES, draw_case, layer_types, partial_rotary_factor
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.families import BY_MODEL_TYPE
from vexact_vllm.option_policy import HYBRID_ENGINE

FAMILIES = {"qwen3", "qwen2", "llama", "qwen3_moe", "deepseek_v3", "deepseek_v2", "qwen3_next", "qwen3_5_text",
            "qwen3_5_moe_text"}  # fmt: skip


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
def test_cases_are_reproducible_and_vary(profile):
    cases = [draw_case(3, i, profile, 500) for i in range(60)]
    assert [c.to_dict() for c in cases] == [draw_case(3, i, profile, 500).to_dict() for i in range(60)]
    assert draw_case(4, 0, profile, 500).to_dict() != cases[0].to_dict()
    limits = PROFILES[profile]
    for c in cases:
        f = c.fields
        head_dim = f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"]
        assert head_dim in limits["head_dims"]
        assert f["num_attention_heads"] % f["num_key_value_heads"] == 0
        assert all(1 <= n <= 500 for n in c.prompt_lens)
        assert len(c.per_request) == len(c.prompt_lens)
        assert {"batch", "shuffled"} <= set(c.compositions)
        assert ("prefix-cache" in c.compositions) == c.engine["enable_prefix_caching"]
        if c.model_type in HYBRIDS:  # the engine vexact serves a hybrid with: never prefix caching
            assert all(c.engine[option] == value for option, (value, _) in HYBRID_ENGINE.items())
            assert not c.engine["enable_prefix_caching"]
        assert c.prefix_len >= 4 * c.block_size + c.block_size // 2
        if c.model_type == "llama":  # transformers refuses a Llama hidden size not divisible by the heads
            assert f["hidden_size"] % f["num_attention_heads"] == 0
    # the draws cover what the fuzzer is for: every family, greedy mixed with sampling, truncation,
    # caching off, a token budget that forces chunked prefill, long and short prompts
    assert {c.model_type for c in cases} == FAMILIES
    temps = [o["temperature"] for c in cases for o in c.per_request]
    assert 0.0 in temps and 0.005 in temps and max(temps) > 1.0
    assert any("top_p" in o for c in cases for o in c.per_request)
    assert any(not c.engine["enable_prefix_caching"] for c in cases)
    assert any(c.engine.get("enable_chunked_prefill") for c in cases)
    assert min(min(c.prompt_lens) for c in cases) < 5 and max(max(c.prompt_lens) for c in cases) > 200
    assert any(c.fields["tie_word_embeddings"] for c in cases) and any(not c.fields["tie_word_embeddings"] for c in cases)


def _hybrids(profile: str, n: int = 40) -> list:
    """The first `n` hybrid cases of a run."""
    cases = (draw_case(5, i, profile, 300) for i in itertools.count())
    return list(itertools.islice((c for c in cases if c.model_type in HYBRIDS), n))


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
def test_hybrid_cases_are_valid_configs_and_vary(profile):
    """Every drawn Qwen3-Next / Qwen3.5 / Qwen3.5-MoE config is one transformers' config class accepts and
    vexact reads (no engine is started); the draws cover the hybrid shapes the fuzzer is for."""
    limits, cases = PROFILES[profile], _hybrids(profile)
    for c in cases:
        f = c.fields
        hf = BY_MODEL_TYPE[c.model_type].hf_config_class()(**f)
        kinds = layer_types(f)
        assert hf.layer_types == kinds and set(kinds) == {"linear_attention", "full_attention"}
        assert limits["hybrid_layers"][0] <= len(kinds) <= limits["hybrid_layers"][1]
        assert hf.rope_parameters["partial_rotary_factor"] == partial_rotary_factor(f)
        if "mrope_section" in f["rope_parameters"]:  # one section per position row, over the rotated pairs
            assert c.model_type.startswith("qwen3_5") and min(f["rope_parameters"]["mrope_section"]) >= 1
            assert 2 * sum(f["rope_parameters"]["mrope_section"]) == int(f["head_dim"] * partial_rotary_factor(f))
        config = DecoderConfig.from_hf(hf)
        lin = config.linear
        assert lin.layers == tuple(i for i, t in enumerate(kinds) if t == "linear_attention")
        assert lin.num_v_heads % lin.num_k_heads == 0 and 2 <= lin.conv_kernel <= 4
        assert {lin.head_k_dim, lin.head_v_dim} <= set(limits["linear_head_dims"])
        assert all(d % 8 == 0 for d in (lin.head_k_dim, lin.head_v_dim))
        assert config.rotary_dim == int(config.head_dim * config.partial_rotary_factor)
        assert (config.moe is not None) == (c.model_type != "qwen3_5_text")
        if config.moe is not None:
            assert config.moe.shared_intermediate_size > 0
        if c.model_type == "qwen3_5_moe_text":  # an MoE block on every layer, no dense MLP
            assert config.intermediate_size == 0 and config.moe.sparse_layers == tuple(range(config.num_layers))
        assert "Gated DeltaNet heads" in c.describe_parts()["model"]
    assert {c.model_type for c in cases} == HYBRIDS == {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
    assert {c.fields["linear_conv_kernel_dim"] for c in cases} == {2, 3, 4}
    assert {partial_rotary_factor(c.fields) for c in cases} == {0.25, 0.5, 1.0}
    assert {layer_types(c.fields)[-1] for c in cases} == {"linear_attention", "full_attention"}
    assert {layer_types(c.fields)[0] for c in cases} == {"linear_attention", "full_attention"}
    assert any("mrope_section" in c.fields["rope_parameters"] for c in cases)
    assert any("full_attention_interval" in c.fields for c in cases) and any("layer_types" in c.fields for c in cases)
    ratios = {c.fields["linear_num_value_heads"] // c.fields["linear_num_key_heads"] for c in cases}
    assert 1 in ratios and max(ratios) > 1
    assert any(c.fields.get("mlp_only_layers") or c.fields.get("decoder_sparse_step", 1) > 1 for c in cases)


def _record(composition, passed, case=1):
    return {"case": case, "seed": 9, "composition": composition, "run": f"{composition} #0", "passed": passed,
            "tokens": 40, "mismatches": 0 if passed else 3, "max_abs_diff": 0.0 if passed else 5e-3,
            "first": None if passed else "request 0, position 12: vLLM -1.0 trainer -1.5", "per_packing": {},
            "problem": None, "notes": {}, "bisect": None, "describe": "qwen3 ..."}  # fmt: skip


def test_report_counts_failures_per_composition_with_a_reproducer():
    records = [_record("batch", True), _record("batch", False), _record("prefix-cache", True), _record("batch", True)]
    idle = {**_record("preemption", True), "inconclusive": True, "problem": "no preemption happened"}
    records.append(idle)
    assert summary(records) == [("batch", 3, 1, 0), ("prefix-cache", 1, 0, 0), ("preemption", 1, 0, 1),
                                ("total", 5, 1, 1)]  # fmt: skip
    args = SimpleNamespace(profile="cuda", max_prompt_len=3000, rounds=2)
    assert reproducer(args, records[1]) == (
        "vexact-vllm fuzz --seed 9 --case 1 --profile cuda --max-prompt-len 3000 --rounds 2 --compositions batch"
    )
    table = to_table(args, records, cases=2, elapsed=1.0)
    assert "FAIL case 1 (seed 9), batch #0" in table and "3 of 40 tokens differ" in table
    assert "reproduce: vexact-vllm fuzz --seed 9 --case 1" in table and table.endswith("s)")
    assert "FAIL: 1 failing runs" in table
    assert "PASS" in to_table(args, [_record("batch", True)], cases=1, elapsed=1.0)


def test_report_says_what_each_case_was():
    """A PASS shows what it covered: the family and sizes, the requests and the engine settings."""
    case = draw_case(1, 3, "cuda", 500)
    parts = case.describe_parts()
    m, e = case.model_summary(), case.engine_summary()
    records = [{**_record(name, True, case=3), "seed": 1, "run": f"{name} #0", "case_parts": parts}
               for name in ("batch", "shuffled")]  # fmt: skip
    records.append({**_record("preemption", True, case=3), "seed": 1, "run": "preemption (9 blocks)",
                    "inconclusive": True, "case_parts": parts})  # fmt: skip
    table = to_table(SimpleNamespace(profile="cuda", max_prompt_len=500, rounds=1), records, cases=1, elapsed=1.0)
    lines = table.splitlines()
    assert lines[0] == "case 3 (seed 1): PASS (1 inconclusive), 3 runs: batch, shuffled, preemption (9 blocks); 120 tokens"
    assert lines[1] == f"  model: {parts['model']}" and lines[2].startswith("  requests: ")
    assert lines[3] == f"  engine: {parts['engine']}"
    model = f"{m['family']}, hidden {m['hidden']}, {m['layers']} layer"
    assert parts["model"].startswith(model) and f"heads {m['heads']}/{m['kv_heads']} x {m['head_dim']}" in parts["model"]
    assert f"vocab {m['vocab']} {'tied' if m['tied'] else 'untied'}" in parts["model"]
    assert f"block {e['block_size']}, max_num_seqs {e['max_num_seqs']}, token budget " in parts["engine"]
    assert "prefix caching o" in parts["engine"] and "CUDA graphs o" in parts["engine"]
    assert "async scheduling o" in parts["engine"]
    assert parts["requests"].startswith(f"{len(case.prompt_lens)} prompts of ")
    cpu = draw_case(1, 0, "cpu", 96).describe_parts()["engine"]
    assert "CUDA graphs n/a (CPU)" in cpu


@pytest.mark.vllm
@pytest.mark.slow
def test_one_cpu_case_end_to_end(tmp_path):
    """Seed 1's case 0: Qwen3-Next, 3 layers (full attention, then two Gated DeltaNet), an MoE with a
    shared expert and a dense layer; about as long on 2 cores as a dense or MoE case."""
    from vexact_vllm.cli import main

    assert draw_case(1, 0, "cpu", 96).model_type == "qwen3_next"

    out = tmp_path / "fuzz.json"
    rc = main(["fuzz", "--cases", "1", "--seed", "1", "--profile", "cpu", "--max-prompt-len", "96", "--rounds", "2",
               "--workdir", str(tmp_path), "--output", str(out)])  # fmt: skip
    records = json.loads(out.read_text())["records"]
    assert rc == 0, records
    assert all(r["passed"] and r["mismatches"] == 0 for r in records)
    assert sum(r["tokens"] for r in records) > 0
    runs = [r["run"] for r in records]
    assert "batch #0" in runs and "batch #1" in runs  # both rounds on the shared engine
    assert all(r["model"]["family"] and r["engine"]["block_size"] for r in records)  # what the case was
    assert all(r["model"]["layer_pattern"] == "FLL" and not r["engine"]["prefix_caching"] for r in records)
    assert "prefix-cache" not in {r["composition"] for r in records}
    assert not list(tmp_path.glob("case-*"))  # passing checkpoints are deleted
