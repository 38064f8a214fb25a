"""`vexact-vllm bench --interleave`: one engine per configuration, side by side, runs alternated. The
first test starts vLLM (two engines); the others drive fake children through the same protocol."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest

from vexact_vllm.cli import bench, bench_interleave, main


@pytest.mark.vllm
@pytest.mark.slow
def test_interleave_starts_each_engine_once_and_alternates(tiny_model, tmp_path, capsys):
    """Two workloads on the same two engines: each engine starts once, serves both workloads' runs
    (its own requests for each: grpo's 2 samples a prompt, decode-small's 1), alternated."""
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", tiny_model("qwen3"), "--configs", "vexact,stock", "--interleave", "--repeats", "2",
        "--workload", "grpo:3,decode-small", "--samples", "1", "--max-model-len", "256",
        "--num-prompts", "3", "--input-len", "8-12", "--output-len", "5", "--warmup-passes", "1",
        "--duration", "0", "--output", str(out), "--enforce-eager",  # no CPU compile: the protocol is tested
        "--engine-kwargs", json.dumps({"kv_cache_memory_bytes": 64 << 20, "block_size": 32}),
    ])  # fmt: skip
    assert rc == 0
    reports = json.loads(out.read_text())["workloads"]
    assert [r["workload"].split(": ")[0].split(", ")[-1] for r in reports] == ["workload grpo:3", "workload decode-small"]
    startups = set()
    for report in reports:
        runs = report["results"]
        assert [(r["repeat"], r["config"]) for r in runs] == bench.run_order(["vexact", "stock"], 2)
        for name in ("vexact", "stock"):
            mine = [r for r in runs if r["config"] == name]
            assert len({r["startup_s"] for r in mine}) == 1  # one engine for every repeat
            startups |= {(name, r["startup_s"]) for r in mine}
            assert all(r["pass_tokens"] == [3 * 5] and r["passes"] == 1 for r in mine)  # --duration 0: one pass
        assert "engines side by side, gpu_memory_utilization 0.45 each" in report["workload"]
        assert report["command"].endswith("--interleave")
        assert [row["runs"] for row in report["summary"]] == [2, 2]
    assert len(startups) == 2  # and the same engine for both workloads
    assert "engines side by side" in capsys.readouterr().err


CHILD = textwrap.dedent("""
    import json, sys
    name = sys.argv[sys.argv.index("--config") + 1]
    kwargs = json.loads(sys.argv[len(sys.argv) - 1 - sys.argv[::-1].index("--engine-kwargs") + 1])
    if name == "broken":
        print("a log line on stdout")
        sys.exit(3)
    print("vLLM says hello")
    print("VEXACT_BENCH_READY " + json.dumps({"startup_s": 1.0, "warmup_s": 0.5}), flush=True)
    runs = 0
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        assert line.split()[0] == "run"
        runs += 1
        if name == "dies" and runs == 2:
            sys.exit(1)
        record = {"config": name, "startup_s": 1.0, "elapsed_s": 2.0, "output_tokens": 10 * runs,
                  "output_tok_s": 5.0 * runs, "passes": 1, "pass_tokens": [10 * runs], "pass_s": [2.0],
                  "device": "Fake", "share": kwargs["gpu_memory_utilization"], "asked": line.split()[1]}
        print("VEXACT_BENCH " + json.dumps(record), flush=True)
""")


def _interleave(tmp_path, names, repeats, workloads=("default",)):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    shared = bench_interleave.shared_engine_kwargs('{"gpu_memory_utilization": 0.8}', len(names))
    command = [sys.executable, str(script), "--engine-kwargs", "{}", "--engine-kwargs", shared]
    args = argparse.Namespace(repeats=repeats)
    return bench_interleave.run_interleaved(names, args, command, lambda n: {}, list(workloads))


def test_runs_alternate_and_each_child_counts_its_own_runs(tmp_path, capsys):
    runs = _interleave(tmp_path, ["a", "b"], 3)
    assert [(r["config"], r["repeat"], r["position"]) for r in runs] == [
        ("a", 0, 0), ("b", 0, 1), ("b", 1, 2), ("a", 1, 3), ("a", 2, 4), ("b", 2, 5)]  # fmt: skip
    assert [r["output_tokens"] for r in runs] == [10, 10, 20, 20, 30, 30]  # each child's 1st, 2nd, 3rd run
    assert {r["share"] for r in runs} == {0.4}  # 0.8 of the GPU between two engines
    assert "vLLM says hello" in capsys.readouterr().err  # untagged child output is passed on


def test_workloads_run_one_after_another_on_the_same_children(tmp_path):
    runs = _interleave(tmp_path, ["a", "b"], 2, workloads=("grpo", "long"))
    assert [(r["workload"], r["config"], r["repeat"], r["position"]) for r in runs] == [
        ("grpo", "a", 0, 0), ("grpo", "b", 0, 1), ("grpo", "b", 1, 2), ("grpo", "a", 1, 3),
        ("long", "a", 0, 0), ("long", "b", 0, 1), ("long", "b", 1, 2), ("long", "a", 1, 3)]  # fmt: skip
    assert all(r["asked"] == r["workload"] for r in runs)  # each run asked for its workload
    assert [r["output_tokens"] for r in runs if r["config"] == "a"] == [10, 20, 30, 40]  # one child throughout


def test_a_failing_child_fails_its_runs_and_the_others_go_on(tmp_path, capsys):
    runs = _interleave(tmp_path, ["broken", "dies", "ok"], 2)
    by = {(r["config"], r["repeat"]): r for r in runs}
    assert "failed" in by[("broken", 0)] and "failed" in by[("broken", 1)]
    assert "failed" not in by[("dies", 0)] and "failed" in by[("dies", 1)]
    assert by[("ok", 0)]["output_tokens"] == 10 and by[("ok", 1)]["output_tokens"] == 20
    err = capsys.readouterr().err
    assert "configuration broken did not start (exit 3)" in err and "a log line on stdout" in err


def test_shared_engine_kwargs_divides_the_memory_and_keeps_the_rest():
    assert json.loads(bench_interleave.shared_engine_kwargs("{}", 2)) == {"gpu_memory_utilization": 0.45}
    got = json.loads(bench_interleave.shared_engine_kwargs('{"gpu_memory_utilization": 0.6, "block_size": 32}', 3))
    assert got == {"gpu_memory_utilization": 0.2, "block_size": 32}


def test_interleave_refuses_profile(capsys):
    with pytest.raises(SystemExit, match="leave out --interleave"):
        main(["bench", "--model", "tiny-qwen3", "--configs", "vexact", "--interleave", "--profile", "x"])
