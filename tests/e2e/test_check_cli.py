"""`vexact-vllm check` end to end on Qwen2- and Llama-architecture checkpoints written with
transformers (the built-in Qwen3 runs in CI as the main job)."""

from __future__ import annotations

import json

import pytest

from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize(("arch", "composition"), [("qwen2", "chunked-prefill"), ("llama", "batch")])
def test_check_passes_on_transformers_checkpoints(tiny_model, arch, composition, tmp_path):
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", tiny_model(arch), "--num-prompts", "6", "--max-tokens", "10",
        "--compositions", composition, "--micro-batches", "1,0", "--json", "--temperature", "0.8",
        "--output", str(out), "--quiet",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["passed"] is True
    assert [r["composition"].split(" ")[0] for r in report["rows"]] == [composition]
    assert all(r["tokens"] == 60 and r["mismatches"] == 0 for r in report["rows"])


def test_check_refuses_too_long_prompt(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("word " * 400 + "\n")
    with pytest.raises(SystemExit, match="exceeds the model length"):
        main(["check", "--model", tiny_model("qwen3"), "--prompts", str(prompts), "--max-model-len", "128"])


def test_check_refuses_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="no config.json"):
        main(["check", "--model", str(tmp_path)])
