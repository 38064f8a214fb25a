"""`vexact-vllm bench`: runs in fresh processes in alternating order, a timed window of whole passes,
the summary over repeats (medians, spread, ratios to stock) and the markdown report. The first test
starts vLLM; the others are pure (fake run records, a fake clock, a fake child)."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import pytest

from vexact_vllm.cli import bench, bench_engine, bench_report, main
from vexact_vllm.kernels.settings import ENV_VARS


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_reports_throughput(tiny_model, tmp_path, capsys):
    """A named workload (grpo: 2 prompts x 2 samples, each its own seed), timed over passes, with
    the markdown report; then one more pass under vLLM's profiler, whose kernel table is written and
    whose tokens are not counted (one engine start for both: CI's time)."""
    out, prof = tmp_path / "bench.json", tmp_path / "prof"
    rc = main([
        "bench", "--model", tiny_model("qwen3"), "--configs", "vexact", "--workload", "grpo", "--num-prompts", "2",
        "--samples", "2", "--input-len", "8-20", "--output-len", "6", "--max-model-len", "256", "--output", str(out),
        "--repeats", "1", "--warmup-passes", "1", "--duration", "0.3", "--report",
        "--profile", str(prof), "--profile-steps", "2:3",
        "--engine-kwargs", json.dumps({"kv_cache_memory_bytes": 64 << 20, "block_size": 32}),
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    (table_file,) = (prof / "vexact").glob("*profiler_out*.txt")
    kernels = table_file.read_text()
    assert "Name" in kernels and "Self CPU" in kernels and len(kernels.splitlines()) > 5
    (profiled,) = report["results"]
    assert profiled["profile"] and profiled["profile"].splitlines()[1] == kernels.splitlines()[1]
    assert "workload grpo: 2 prompts of 8-20 tokens x 2 samples" in report["workload"]
    assert "--workload" in report["forwarded"] and "--samples" in report["forwarded"]
    assert [(r["config"], r["repeat"]) for r in report["results"]] == [("vexact", 0)]
    for result in report["results"]:
        assert result["pass_tokens"] == [4 * 6] * result["passes"]  # every pass the whole workload
        assert result["output_tokens"] == 4 * 6 * result["passes"]
        assert result["elapsed_s"] >= 0.3 and result["warmup_s"] > 0 and result["startup_s"] > 0
        assert result["output_tok_s"] == pytest.approx(result["output_tokens"] / result["elapsed_s"])
        assert result["device"] == "CPU"
    (row,) = report["summary"]
    assert row["runs"] == 1 and row["tok_s_min"] <= row["tok_s_median"] <= row["tok_s_max"]
    captured = capsys.readouterr()
    assert "profile, " in captured.err
    table, markdown = captured.out.split("\n## ")
    assert table.splitlines()[1].startswith("settings: VEXACT_ATTENTION=")
    assert table.splitlines()[3].split()[:2] == ["vexact", "1"]
    assert "| vexact | 1 |" in markdown and "--duration 0.3" in markdown


@pytest.mark.parametrize("window", ["30", "-1:5", "3:0", "a:b"])
def test_bench_refuses_bad_profile_window(window, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--model", "tiny-qwen3", "--configs", "vexact", "--profile", "x", "--profile-steps", window])
    assert "SKIP:STEPS" in capsys.readouterr().err


def test_workloads_fill_what_the_command_line_leaves_unset():
    from types import SimpleNamespace

    from vexact_vllm.cli.bench_workloads import WORKLOADS, apply_workload, requests

    args = SimpleNamespace(workload="grpo", num_prompts=3, input_len=None, output_len="5-9", samples=None,
                           max_model_len=None, seed=7, vocab_limit=400)  # fmt: skip
    apply_workload(args)
    assert (args.num_prompts, args.output_len) == (3, "5-9")  # given: kept
    assert (args.input_len, args.samples, args.max_model_len) == ("256-1024", 8, 3072)  # the workload's
    reqs = requests(args)
    assert len(reqs) == 3 * 8 and len({r.seed for r in reqs}) == 24
    for p in range(3):  # a prompt's samples: the same ids, their own seeds and lengths
        group = reqs[p * 8 : (p + 1) * 8]
        assert all(r.prompt == group[0].prompt for r in group) and 256 <= len(group[0].prompt) <= 1024
        assert all(5 <= r.max_tokens <= 9 for r in group)
    assert reqs[0].prompt != reqs[8].prompt
    assert requests(args) == reqs  # every pass replays the same requests
    assert set(WORKLOADS) == {"default", "long", "grpo", "decode-small"}


def test_workload_list_names_known_workloads_once():
    from vexact_vllm.cli.bench_workloads import workload_list

    assert workload_list("grpo, long") == "grpo,long"
    assert workload_list("grpo:32,default") == "grpo:32,default"
    for bad in ("fast", "grpo,grpo", ",", "default,fast", "grpo:0", "grpo:x", "grpo,grpo:32", "fast:3"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
            workload_list(bad)


def test_several_workloads_run_one_after_another(monkeypatch, tmp_path, capsys):
    """Without --interleave each workload runs as its own bench (fresh processes, its own fields, the
    command line's overrides kept); --output saves one report per workload."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 448}))
    monkeypatch.setattr(bench, "resolve_model", lambda name, load_format: str(tmp_path))
    seen = []

    def fake_child(name, repeat, args):
        seen.append(args)
        return {"config": name, "repeat": repeat, "output_tok_s": 1.0, "startup_s": 1.0, "elapsed_s": 1.0,
                "output_tokens": 1, "passes": 1, "device": "Fake GPU"}  # fmt: skip

    monkeypatch.setattr(bench, "_run_child", fake_child)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", "tiny-qwen3", "--configs", "vexact", "--workload", "grpo:3,decode-small,default",
               "--num-prompts", "4", "--output-len", "9", "--repeats", "1", "--output", str(out)])  # fmt: skip
    assert rc == 0
    assert [a.workload for a in seen] == ["grpo:3", "decode-small", "default"]
    fields = [(a.num_prompts, a.samples, a.output_len, a.max_model_len) for a in seen]
    # each workload its own fields; the command line's overrides for all; grpo:3 its own prompt count
    assert fields == [(3, 8, "9-9", 3072), (4, 1, "9-9", 1536), (4, 1, "9-9", 1024)]
    assert seen[0].forward[seen[0].forward.index("--workload") + 1] == "grpo:3"
    reports = json.loads(out.read_text())["workloads"]
    assert "workload grpo:3: 3 prompts of 256-1024 tokens x 8 samples" in reports[0]["workload"]
    assert "workload decode-small: 4 prompts of 64-511 tokens, 9-9 output tokens" in reports[1]["workload"]
    assert capsys.readouterr().out.count("configuration") == 3  # a summary table per workload


def test_ab_variants_are_asked_for_by_name_only(monkeypatch):
    """The vexact-* variants run only when named; each is vexact with one user setting (the
    shared-prompt groups: the key split off too)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.default_configs() == ["stock", "stock-batch-invariant", "vexact"]
    variants = {name: cfg for name, cfg in bench.CONFIGS.items() if name.startswith("vexact-")}
    assert set(variants) == {"vexact-shared-prefix", "vexact-fa4", "vexact-nosplit", "vexact-split1024",
                             "vexact-split2048"}  # fmt: skip
    shared = variants.pop("vexact-shared-prefix")  # the groups take no key split: it turns the default off
    assert shared["env"] == {"VEXACT_SHARED_PREFIX": "1", "VEXACT_KEY_SPLIT": "0"}
    assert variants["vexact-nosplit"]["env"] == {"VEXACT_KEY_SPLIT": "0"}
    assert all(cfg["model_impl"] == "vexact" and len(cfg["env"]) == 1 for cfg in variants.values())
    assert all(name in ENV_VARS for cfg in bench.CONFIGS.values() for name in cfg["env"] if name.startswith("VEXACT_"))


def test_bench_refuses_unknown_configuration_and_bad_counts():
    with pytest.raises(SystemExit, match="unknown configuration"):
        main(["bench", "--model", "tiny-qwen3", "--configs", "fastest"])
    with pytest.raises(SystemExit, match="--repeats must be at least 1"):
        main(["bench", "--model", "tiny-qwen3", "--configs", "vexact", "--repeats", "0"])


@pytest.mark.parametrize("text", ["32,64", "64-32", "0-5", "a-b", "1-2-3", ""])
def test_bench_refuses_bad_input_len_before_starting_vllm(text, capsys):
    # "32,64" once reached the per-configuration children, each of which failed after vLLM's start-up.
    with pytest.raises(SystemExit):
        main(["bench", "--model", "tiny-qwen3", "--configs", "vexact", "--input-len", text])
    assert "length range" in capsys.readouterr().err


def test_input_len_accepts_a_range_or_one_length():
    from vexact_vllm.cli.bench import length_range

    assert length_range("64-511") == "64-511" and length_range("100") == "100-100"


def test_run_order_alternates():
    names = ["stock", "stock-batch-invariant", "vexact"]
    assert bench.run_order(names, 3) == [
        (0, "stock"), (0, "stock-batch-invariant"), (0, "vexact"),
        (1, "vexact"), (1, "stock-batch-invariant"), (1, "stock"),
        (2, "stock"), (2, "stock-batch-invariant"), (2, "vexact"),
    ]  # fmt: skip
    assert bench.run_order(["vexact"], 2) == [(0, "vexact"), (1, "vexact")]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("duration, passes", [(0, 1), (2.9, 1), (3, 1), (10, 4), (12, 4), (12.5, 5)])
def test_timed_passes_fill_the_window(duration, passes):
    clock, calls = FakeClock(), []

    def generate() -> int:  # a pass of 3 s and 24 tokens
        calls.append("generate")
        clock.now += 3.0
        return 24

    def before() -> None:  # untimed: resetting the prefix cache must not count
        calls.append("before")
        clock.now += 100.0

    got = bench_engine.timed_passes(generate, duration, before=before, clock=clock)
    assert got == [(24, 3.0)] * passes
    assert calls == ["before", "generate"] * passes


def _run(config, repeat, tok_s, startup):
    return {"config": config, "repeat": repeat, "output_tok_s": tok_s, "startup_s": startup}


RUNS = [
    _run("stock", 0, 20000.0, 60.0), _run("stock-batch-invariant", 0, 19000.0, 90.0), _run("vexact", 0, 16000.0, 20.0),
    _run("vexact", 1, 21000.0, 15.0), _run("stock-batch-invariant", 1, 19000.0, 80.0), _run("stock", 1, 22000.0, 40.0),
    _run("stock", 2, 21000.0, 50.0), _run("stock-batch-invariant", 2, 20000.0, 70.0),
    {"config": "vexact", "repeat": 2, "failed": "exit 1, see its log on stderr"},
]  # fmt: skip


def test_summary_medians_spread_and_ratios():
    stock, bi, vexact = bench_report.summarize(RUNS)
    assert [stock["config"], bi["config"], vexact["config"]] == ["stock", "stock-batch-invariant", "vexact"]
    assert (stock["runs"], stock["started"], vexact["runs"], vexact["started"]) == (3, 3, 2, 3)
    assert (stock["tok_s_median"], stock["tok_s_min"], stock["tok_s_max"]) == (21000, 20000, 22000)
    assert stock["spread"] == pytest.approx(0.1) and stock["startup_s_median"] == 50
    assert vexact["tok_s_median"] == 18500 and vexact["startup_s_median"] == 17.5
    assert vexact["tok_s_vs_stock"] == pytest.approx(18500 / 21000)
    assert vexact["startup_vs_stock"] == pytest.approx(0.35)
    assert vexact["per_repeat_vs_stock"] == pytest.approx([16000 / 20000, 21000 / 22000])  # failed repeat 2 left out
    assert vexact["vs_bi"] == pytest.approx(18500 / 19000)
    assert vexact["failed"] == ["repeat 2: exit 1, see its log on stderr"]
    assert "per_repeat_vs_stock" not in stock and "vs_bi" not in bi


def test_summary_table():
    lines = bench_report.summary_table(bench_report.summarize(RUNS)).splitlines()
    assert lines[0].split()[:3] == ["configuration", "runs", "start-up"]
    assert lines[1].split() == ["stock", "3", "50.0", "1.000", "21000", "20000", "22000", "10.0%", "1.000", "-", "-",
                                "-"]  # fmt: skip
    assert lines[3].split() == ["vexact", "2/3", "17.5", "0.350", "18500", "16000", "21000", "31.2%", "0.881",
                                "0.800..0.955", "0.974", "-"]  # fmt: skip
    assert lines[-1] == "failed: vexact: run of repeat 2: exit 1, see its log on stderr"
    alone = bench_report.summary_table(bench_report.summarize(RUNS[2:4])).splitlines()[1].split()
    assert alone[-5:] == ["31.2%", "-", "-", "-", "-"]  # no stock: no ratios
    all_failed = bench_report.summary_table(bench_report.summarize(RUNS[8:])).splitlines()[1]
    assert all_failed.split() == ["vexact", "0/1", "failed:", "repeat", "2:", "exit", "1,", "see", "its", "log", "on",
                                  "stderr"]  # fmt: skip


def test_pass_drift_orders_runs_and_compares_halves():
    early = {"config": "vexact", "position": 0, "pass_s": [3.0, 3.2, 3.1]}
    late = {"config": "vexact", "position": 2, "pass_s": [3.6, 3.8]}
    # passes in run order 3.0 3.2 3.1 3.6 3.8: later half (3.6, 3.8) over the earlier (3.0, 3.2)
    assert bench_report.pass_drift([late, early]) == pytest.approx(3.7 / 3.1 - 1)
    assert bench_report.pass_drift([{"pass_s": [2.0, 1.5]}]) == pytest.approx(-0.25)
    assert bench_report.pass_drift([{"pass_s": [2.0]}]) is None and bench_report.pass_drift([{}]) is None
    (row,) = bench_report.summarize([{**early, "output_tok_s": 1.0, "startup_s": 1.0}])
    assert row["pass_drift"] == pytest.approx(3.1 / 3.0 - 1)
    assert bench_report.summary_table([row]).splitlines()[1].split()[-1] == "+3.3%"


def test_markdown_report():
    meta = {"date": "2026-11-25", "device": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
            "command": "vexact-vllm bench --repeats 3", "workload": "qwen3-1.7b-shape (dummy weights)"}  # fmt: skip
    text = bench_report.markdown_report(bench_report.summarize(RUNS), meta)
    lines = text.splitlines()
    assert lines[0] == "## 2026-11-25: `vexact-vllm bench`, NVIDIA H100 80GB HBM3"
    assert "Commit: abc1234. Command: `vexact-vllm bench --repeats 3`" in lines
    assert "Settings: `VEXACT_ATTENTION=triton`." in bench_report.markdown_report(
        bench_report.summarize(RUNS), {**meta, "settings": "VEXACT_ATTENTION=triton"}).splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    assert table[0].startswith("| configuration | runs |") and set(table[1].replace(" ", "")) == {"|", "-"}
    assert table[2] == "| stock | 3 | 50.0 | 1.000 | 21,000 | 20,000 | 22,000 | 10.0% | 1.000 | - | - | - |"
    assert table[4] == "| vexact | 2/3 | 17.5 | 0.350 | 18,500 | 16,000 | 21,000 | 31.2% | 0.881 | 0.800..0.955 | 0.974 | - |"
    assert {ln.count("|") for ln in table} == {13}  # every row has the header's 12 cells
    failed_only = bench_report.markdown_report(bench_report.summarize(RUNS[8:]), meta)
    assert "| vexact | 0/1 | failed: repeat 2: exit 1, see its log on stderr | - |" in failed_only
    assert failed_only.count("|") == 3 * 13


def test_run_bench_alternates_keeps_going_after_a_failure_and_prints_the_table_last(monkeypatch, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 448}))
    monkeypatch.setattr(bench, "resolve_model", lambda name, load_format: str(tmp_path))
    by_repeat = {(r["config"], r["repeat"]): r for r in RUNS}
    calls = []

    def fake_child(name, repeat, args):
        calls.append((repeat, name))
        assert args.forward[args.forward.index("--duration") + 1] == "5.0"
        return {**by_repeat[(name, repeat)], "device": "Fake GPU"}

    monkeypatch.setattr(bench, "_run_child", fake_child)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", "tiny-qwen3", "--configs", "stock,stock-batch-invariant,vexact", "--repeats", "3",
               "--duration", "5", "--report", "--output", str(out)])  # fmt: skip
    assert rc == 1  # vexact's repeat 2 failed; every other run still ran
    assert calls == bench.run_order(["stock", "stock-batch-invariant", "vexact"], 3)
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith("tiny-qwen3 (dummy weights), workload default: 256 prompts of 64-511 tokens")
    assert "5 s timed per run" in stdout[0]
    assert stdout[1].startswith("settings: VEXACT_ATTENTION=")  # the header: workload, then settings
    assert stdout[2].startswith("configuration") and stdout[5].startswith("vexact")
    assert stdout[-1] == "Failed: vexact: run of repeat 2: exit 1, see its log on stderr."
    assert any(ln.startswith("## ") and ln.endswith("Fake GPU") for ln in stdout)
    saved = json.loads(out.read_text())
    assert [r["position"] for r in saved["results"]] == list(range(9))
    assert {"model", "model_name", "workload", "forwarded", "results", "summary", "commit", "command", "settings"} <= set(saved)
    assert saved["repeats"] == 3 and saved["duration_s"] == 5.0 and saved["device"] == "Fake GPU"


def test_command_line_reparses_to_the_same_workload(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 448}))
    monkeypatch.setattr(bench, "resolve_model", lambda name, load_format: str(tmp_path))
    seen = []

    def fake_child(name, repeat, args):
        seen.append(args)
        return {"config": name, "repeat": repeat, "failed": "fake"}

    monkeypatch.setattr(bench, "_run_child", fake_child)
    monkeypatch.setattr(sys, "argv", ["pytest"])  # called as a function: the command is rebuilt from the options
    main(["bench", "--model", "tiny-qwen3", "--configs", "vexact", "--num-prompts", "4", "--duration", "0",
          "--enforce-eager", "--repeats", "1"])  # fmt: skip
    argv = shlex.split(bench._command_line(seen[0]))
    assert argv[:2] == ["vexact-vllm", "bench"] and argv[argv.index("--model") + 1] == "tiny-qwen3"
    main(argv[1:])
    assert seen[1].forward == seen[0].forward and (seen[1].configs, seen[1].repeats) == ("vexact", 1)
    assert "--enforce-eager" in seen[1].forward and seen[1].num_prompts == 4
    monkeypatch.setattr(sys, "argv", ["/usr/bin/vexact-vllm", "bench", "--duration", "0"])  # run from the shell
    assert bench._command_line(seen[0]) == "vexact-vllm bench --duration 0"


def test_git_commit(monkeypatch):
    commit = bench_report.git_commit()
    assert commit == "unknown" or len(commit.split()[0]) >= 7

    def no_git(*args, **kwargs):
        raise subprocess.CalledProcessError(128, "git")

    monkeypatch.setattr(bench_report.subprocess, "run", no_git)
    assert bench_report.git_commit() == "unknown"


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallel_sizes_reach_every_child(name):
    """`--tensor-parallel-size` and `--pipeline-parallel-size` are forwarded to each configuration's
    process (stock and vexact alike)."""
    import argparse

    from vexact_vllm.cli.bench import add_arguments, forward_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flag = "--" + name.replace("_", "-")
    forwarded = forward_args(parser.parse_args([flag, "2"]))
    assert forwarded[forwarded.index(flag) + 1] == "2"
    assert getattr(parser.parse_args(forwarded), name) == 2
    assert getattr(parser.parse_args([]), name) == 1


def test_settings_line_names_what_each_configuration_sets_itself(monkeypatch):
    from vexact_vllm.kernels.settings import refresh_settings

    monkeypatch.delenv("VEXACT_KEY_SPLIT", raising=False)
    refresh_settings()
    assert bench.settings_line(["stock", "vexact"]) == refresh_settings().describe()
    own = [n for n, c in bench.CONFIGS.items() if any(k.startswith("VEXACT_") for k in c["env"])]
    if own:  # a variant that sets a VEXACT_* variable of its own
        env = " ".join(f"{k}={v}" for k, v in bench.CONFIGS[own[0]]["env"].items() if k.startswith("VEXACT_"))
        assert bench.settings_line(["vexact", own[0]]).endswith(f"; {own[0]} sets {env}")


@pytest.mark.vllm
def test_engines_get_the_checkpoints_engine_arguments_under_the_users(monkeypatch):
    """Each configuration's engine gets what the checkpoint asks of it (model_engine.py: stock's side
    asked as stock), --engine-kwargs over them; the report line names them per configuration."""
    import vllm

    from vexact_vllm.cli import model_engine, stock_layout
    from vexact_vllm.cli.bench import add_arguments

    seen = {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen[kwargs["model_impl"]] = {**kwargs, "model": model}

    asked = lambda path, stock: {"enable_prefix_caching": False, **({"language_model_only": True} if stock else {})}
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(model_engine, "model_engine_kwargs", asked)
    monkeypatch.setattr(stock_layout, "stock_checkpoint", lambda path: path + "-published")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for config, user in (("stock", {"language_model_only": False, "block_size": 32}), ("vexact", {"block_size": 32})):
        args = parser.parse_args(["--engine-kwargs", json.dumps(user)])
        args.model, args.config, args.vocab_limit = "/some/checkpoint", config, 100
        bench_engine.EngineRun(args)
    assert seen["vllm"]["enable_prefix_caching"] is False and seen["vllm"]["language_model_only"] is False
    assert seen["vexact"]["enable_prefix_caching"] is False and "language_model_only" not in seen["vexact"]
    assert seen["vllm"]["block_size"] == seen["vexact"]["block_size"] == 32
    assert seen["vllm"]["model"] == "/some/checkpoint-published" and seen["vexact"]["model"] == "/some/checkpoint"
    line = bench_engine.checkpoint_line("/some/checkpoint", ["stock", "vexact"])
    assert line == "stock: enable_prefix_caching=False, language_model_only=True; vexact: enable_prefix_caching=False"
    monkeypatch.setattr(model_engine, "model_engine_kwargs", lambda path, stock: {})
    assert bench_engine.checkpoint_line("/some/checkpoint", ["stock", "vexact"]) == ""


def test_vocab_size_of_a_vision_language_checkpoint(tmp_path):
    """The ids drawn stay below the vocabulary, which a vision-language config.json keeps in text_config."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 448}, "vision_config": {}}))
    assert bench._vocab_size(str(tmp_path)) == 448
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert bench._vocab_size(str(tmp_path)) == 151936
