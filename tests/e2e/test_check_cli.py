"""`vexact-vllm check` end to end on Qwen2-, Llama- and Qwen3-MoE-architecture checkpoints written
with transformers (the built-in Qwen3 runs in CI as the main job)."""

from __future__ import annotations

import json

import pytest

from vexact_vllm.cli import main

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize(("arch", "composition"), [("qwen2", "chunked-prefill"), ("llama", "batch"),
                                                   ("qwen3_moe", "preemption")])
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
    tokens = 6 * (33 if composition == "preemption" else 10)  # preemption: past a 32-token block
    assert all(r["tokens"] == tokens and r["mismatches"] == 0 for r in report["rows"])


def test_check_refuses_too_long_prompt(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("word " * 400 + "\n")
    with pytest.raises(SystemExit, match="exceeds the model length"):
        main(["check", "--model", tiny_model("qwen3"), "--prompts", str(prompts), "--max-model-len", "128"])


def test_check_refuses_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="no config.json"):
        main(["check", "--model", str(tmp_path)])


def test_check_prefix_cache_and_eager(tiny_model, tmp_path):
    """prefix-cache reports its cache hits (and would fail on none); eager runs on request on CPU."""
    out = tmp_path / "report.json"
    argv = [
        "check", "--model", tiny_model("qwen3"), "--num-prompts", "4", "--max-tokens", "8",
        "--compositions", "prefix-cache,eager", "--micro-batches", "1,0", "--json", "--output", str(out), "--quiet",
    ]  # fmt: skip
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "diff.png")]
    except ImportError:
        pass
    rc = main(argv)
    report = json.loads(out.read_text())
    assert rc == 0, report
    pc, eager = report["rows"]
    assert pc["composition"].startswith("prefix-cache (") and eager["composition"] == "eager"
    assert pc["tokens"] == 3 * 4 * 8 and eager["tokens"] == 4 * 8  # first, again, continued
    hits = pc["notes"]["prefix-cache hits"]
    assert hits.endswith(" tok") and int(hits.split()[0]) >= 3 * 4 * 32, hits  # 4 shared blocks, most requests
    assert pc["problem"] is None and pc["mismatches"] == eager["mismatches"] == 0
    if "--plot" in argv:
        assert (tmp_path / "diff.png").read_bytes()[:4] == b"\x89PNG"


def test_check_refuses_an_unknown_attention_before_generating(tmp_path, monkeypatch):
    """VEXACT_ATTENTION is read by both sides: a bad value stops the check before any engine starts."""
    monkeypatch.setenv("VEXACT_ATTENTION", "flash3")
    with pytest.raises(SystemExit, match="VEXACT_ATTENTION must be one of triton, fa4"):
        main(["check", "--model", str(tmp_path)])


def test_check_refuses_a_bad_key_split_before_generating(tmp_path, monkeypatch):
    """VEXACT_KEY_SPLIT is read by both sides too: a bad value stops the check before any engine starts."""
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "100")
    with pytest.raises(SystemExit, match=r"VEXACT_KEY_SPLIT must be 0 \(no split\) or a positive multiple of 64 keys"):
        main(["check", "--model", str(tmp_path)])
