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


def _long_prompts(path, tokenizer_path: str) -> None:
    """Four prompts of 300-600 tokens, all opening with the same system text (several KV blocks the
    prefix cache shares between them)."""
    import random

    from transformers import AutoTokenizer

    rng = random.Random(5)
    words = "the of and to in is was for on that with as by at from his her an which were are this be had".split()
    system = "You are a careful assistant. Read the question, think about it step by step, and answer. " * 3
    lines = [system + " ".join(rng.choice(words) for _ in range(n)) for n in (72, 110, 150, 190)]
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(tokenizer_path)(lines)["input_ids"]]
    assert 300 <= min(lengths) and max(lengths) <= 600, lengths
    path.write_text("\n".join(lines) + "\n")


def test_check_preempts_with_long_prompts(tiny_model, tmp_path):
    """The preemption composition sizes its cache from the prompts: long ones (sharing a prefix) too."""
    prompts, out = tmp_path / "long.txt", tmp_path / "report.json"
    _long_prompts(prompts, tiny_model("qwen3"))
    rc = main(["check", "--model", tiny_model("qwen3"), "--prompts", str(prompts), "--num-prompts", "4",
               "--compositions", "preemption", "--micro-batches", "0", "--json", "--output", str(out), "--quiet"])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report
    (row,) = report["rows"]
    assert row["problem"] is None and row["mismatches"] == 0 and row["notes"]["preemptions"] > 0, row


def _checkpoint_with(tiny_model, tmp_path, **fields) -> str:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(fields)
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


def test_check_refuses_a_float16_checkpoint_as_the_server_does(tiny_model, tmp_path):
    model = _checkpoint_with(tiny_model, tmp_path, dtype="float16", torch_dtype="float16")
    with pytest.raises(SystemExit, match=r"dtype torch.float16 is not supported by vexact-vllm; use bfloat16 or "
                       r"float32 \(for example --dtype bfloat16\)"):  # fmt: skip
        main(["check", "--model", model])


def test_check_runs_a_float16_checkpoint_in_the_dtype_asked_for(tiny_model, tmp_path, capsys):
    model = _checkpoint_with(tiny_model, tmp_path, dtype="float16", torch_dtype="float16")
    rc = main(["check", "--model", model, "--dtype", "bfloat16", "--num-prompts", "3", "--max-tokens", "4",
               "--compositions", "batch", "--micro-batches", "0", "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "note: the checkpoint's config says float16; checked in bfloat16 as --dtype asks" in out
    assert " in bfloat16, 3 prompts x 4 tokens" in out and out.rstrip().endswith("PASS: every token matches bit for bit")


def _gpt2_checkpoint(tiny_model, tmp_path) -> str:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    model = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=len(tokenizer))).save_pretrained(model)
    tokenizer.save_pretrained(model)
    return str(model)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("gpt2", "error: --model-impl vexact does not support architecture GPT2LMHeadModel; supported: "),
        ("sliding-window", "error: sliding-window attention is not supported by vexact-vllm; set use_sliding_window=false"),
    ],
)
def test_a_refusal_of_vllms_config_is_one_line(tiny_model, tmp_path, case, message):
    """An unsupported architecture or option, refused while vLLM builds its configuration: the check
    prints the message alone (no traceback, no vLLM log) and exits non-zero."""
    import os
    import subprocess
    import sys

    if case == "gpt2":
        model = _gpt2_checkpoint(tiny_model, tmp_path)
    else:
        model = _checkpoint_with(tiny_model, tmp_path, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    proc = subprocess.run([sys.executable, "-m", "vexact_vllm.cli", "check", "--model", model],
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, timeout=300)  # fmt: skip
    # as a terminal shows it: a progress bar's updates overwrite each other (carriage returns)
    lines = [line.rsplit("\r", 1)[-1] for line in (proc.stdout + proc.stderr).decode().split("\n")]
    lines = [line for line in lines if line.strip()]
    assert proc.returncode == 1
    assert len(lines) == 1 and lines[0].startswith(message), lines[-40:]
    if case == "gpt2":  # what to do, said for the check: it has no --model-impl
        from vexact_vllm.cli.check import CHECK_ADVICE

        assert lines[0].endswith(CHECK_ADVICE) and "--model-impl for" not in lines[0], lines[0]
