"""benchmarks/bench_gated_delta.py end to end on the CPU (--small, the Triton interpreter): C's
decode == training check, every case timed or skipped with its reason, the JSON report and the
docs/results.jsonl rows (valid for scripts/results_page.py). The GPU-only arithmetic (the ratios to the
reference, the outputs' differences from C's) on synthetic results; the baselines' adapter on a stand-in
kernel against C."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gated_delta.py"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gdn")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--small",
        "--output",
        str(out / "r.json"),
        "--jsonl",
        str(out / "r.jsonl"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads((out / "r.json").read_text()), out / "r.jsonl"


def test_smoke_run_checks_and_times_c(smoke_run):
    stdout, report, _ = smoke_run
    rows = report["rows"]
    checks = [r for r in rows if r["case"] == "check"]
    assert [r["system"] for r in checks] == ["C"]
    assert checks[0]["decode_equals_training"] and checks[0]["first_difference"] is None
    by = {(r["case"], r["system"]): r for r in rows if r["case"] != "check"}
    assert by[("train", "C")]["fwd_ms"] > 0 and by[("train", "C")]["fwd_bwd_ms"] > 0
    assert by[("prefill", "C")]["fwd_ms"] > 0 and by[("prefill", "C")]["tokens_per_s"] > 0
    assert all(by[("decode", f"C@{p}")]["fwd_ms"] > 0 for p in (0, 31, 63))
    for case, ours in (("train", "C"), ("prefill", "C"), ("decode", "C@0")):  # C's output, against itself
        assert by[(case, ours)]["max_abs_diff_vs_c"] == 0.0
    assert all("max_abs_diff_vs_c" not in by[("decode", f"C@{p}")] for p in (31, 63))  # other rows held
    for name in ("fla-chunk", "vllm-chunk", "fla-recurrent", "vllm-decode"):
        case = "decode" if name in ("fla-recurrent", "vllm-decode") else "train"
        assert by[(case, name)]["skipped"] == "needs CUDA"
    assert not any("fwd_vs_ref" in r for r in rows)  # no reference ran
    assert {r["system"] for r in rows} == {"C", "C@0", "C@31", "C@63", "fla-chunk", "vllm-chunk", "fla-recurrent",
                                           "vllm-decode"}  # fmt: skip
    assert not any("error" in r for r in rows)
    assert "decode == training" in stdout and "Triton interpreter" in stdout and "max |o - C|" in stdout


def test_smoke_run_writes_results_rows(smoke_run):
    _, report, jsonl = smoke_run
    page = _load(ROOT / "scripts" / "results_page.py", "results_page_for_gdn")
    rows = page.load_rows(jsonl)  # raises on a missing or unknown field, a bad or repeated id
    assert [r["id"] for r in rows] == [
        "gdn-train-cpu",
        "gdn-prefill-cpu",
        "gdn-decode-cpu",
        "gdn-bitwise-cpu",
    ]
    assert rows[3]["value"] == "PASS: C at 4 v heads: equal"
    assert "C " in rows[0]["value"] and " / -" not in rows[0]["value"]  # C's forward / forward+backward
    assert "Absent baselines: fla-chunk, fla-recurrent, vllm-chunk, vllm-decode" in rows[0]["notes"]
    assert rows[0]["commit"] == report["environment"]["commit"][:7]
    page.render(rows)


def _bench(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return _load(SCRIPT, name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_ratios_differences_and_gpu_rows():
    """_compare on synthetic results: each time over the reference's (fla's chunk kernel, vLLM's where fla
    did not run, vLLM's decode step), each output's largest difference from C's (C@0's at decode); then the
    report's table and results rows of them."""
    import torch

    bench = _bench("bench_gated_delta_for_test")
    o = torch.zeros(6, 4, 16)

    def compared(case, results):
        rows = [{"case": case, "v_heads": 32, "size": "8192x2048", "system": name,
                 **{k: v for k, v in r.items() if k != "out"}} for name, r in results.items()]  # fmt: skip
        bench._compare(case, rows, results)
        return {r["system"]: r for r in rows}

    train = compared("train", {"C": {"fwd_ms": 2.0, "fwd_bwd_ms": 8.0, "out": o},
                               "fla-chunk": {"fwd_ms": 1.0, "fwd_bwd_ms": 5.0, "out": o + 0.5},
                               "vllm-chunk": {"fwd_ms": 4.0, "out": o - 0.25}})  # fmt: skip
    assert [train[s]["fwd_vs_ref"] for s in ("C", "fla-chunk", "vllm-chunk")] == [2.0, 1.0, 4.0]
    assert train["C"]["fwd_bwd_vs_ref"] == 1.6 and "fwd_bwd_vs_ref" not in train["vllm-chunk"]
    assert [train[s]["max_abs_diff_vs_c"] for s in ("C", "fla-chunk", "vllm-chunk")] == [0.0, 0.5, 0.25]
    prefill = compared("prefill", {"C": {"fwd_ms": 3.0, "out": o}, "vllm-chunk": {"fwd_ms": 1.5, "out": o}})
    assert prefill["C"]["fwd_vs_ref"] == 2.0  # no fla: vLLM's is the reference
    decode = compared("decode", {"C@0": {"fwd_ms": 0.01, "out": o[:, :, :8]}, "C@31": {"fwd_ms": 0.02},
                                 "vllm-decode": {"fwd_ms": 0.04, "out": o[:, :, :8] + 1.0}})  # fmt: skip
    assert decode["C@31"]["fwd_vs_ref"] == 0.5 and "max_abs_diff_vs_c" not in decode["C@31"]
    assert decode["vllm-decode"]["max_abs_diff_vs_c"] == 1.0 and decode["C@0"]["max_abs_diff_vs_c"] == 0.0

    rows = [*train.values(), {"case": "train", "v_heads": 48, "size": "8192x2048", "system": "fla-chunk",
                              "skipped": "not importable: fla"}]  # fmt: skip
    env = {"date": "2026-01-01T00:00:00+00:00", "device": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
           "fla": None, "vllm": "0.26.0", "commit": "0123456789", "command": "python bench"}  # fmt: skip
    out = bench.results_rows({"environment": env, "shape": bench.FULL, "rows": rows})
    assert [r["id"] for r in out] == ["gdn-train-h200"]  # no prefill, decode or check rows to report
    assert "C 2.00 / 8.00" in out[0]["value"] and "vllm-chunk 4.00 / -" in out[0]["value"]
    assert "Absent baselines: fla-chunk;" in out[0]["notes"]
    assert "fla absent" in out[0]["device"] and out[0]["commit"] == "0123456"
    lines = bench.table(rows).splitlines()
    assert "max |o - C|" in lines[0] and lines[0].count("vs ref") == 2
    assert lines[1].split()[4:] == ["2.000", "2.00", "8.000", "1.60", "-", "0.00e+00"]  # C
    assert lines[2].split()[4:] == ["1.000", "1.00", "5.000", "1.00", "-", "5.00e-01"]  # fla-chunk


def test_chunked_baseline_adapter_matches_c():
    """_fla_chunk_run's conventions (gates as transformers computes them, q, k repeated over the v heads
    for a kernel refusing GQA, the [1, T, ...] batch, one kernel call a run) on a stand-in kernel that
    runs transformers' Qwen3-Next recurrence per sequence: its output is C's to rounding (fp32 inputs:
    C regroups the recurrence by chunks, about 1e-7 apart; a gate off by 0.01 moves it by about 1e-4)."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    import torch

    bench = _bench("bench_gated_delta_for_adapter")
    calls = []

    def chunk_fn(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel):
        calls.append(q.shape)
        if q.shape[2] != v.shape[2]:
            raise ValueError("no GQA")
        cu = cu_seqlens.tolist()
        outs = [
            modeling.torch_recurrent_gated_delta_rule(
                *(t[:, cu[n] : cu[n + 1]] for t in (q, k, v, g, beta)), initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )[0]
            for n in range(len(cu) - 1)
        ]  # fmt: skip
        return torch.cat(outs, 1), None

    x = bench._inputs([5, 1, 7], bench.SMALL, 4, "cpu")
    x = {k: (t.float() if k in ("q", "k", "v", "a", "b") else t) for k, t in x.items()}
    run = bench._fla_chunk_run(x, chunk_fn)
    assert [s[2] for s in calls] == [2]  # the probe, refused
    out = run(x)
    assert out.shape == x["v"].shape and [s[2] for s in calls] == [2, 4]  # one call, q and k over the v heads
    from vexact_vllm.kernels.gated_delta.incremental import incremental_gated_delta_rule

    want, _ = incremental_gated_delta_rule(
        *(x[k] for k in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "cu_seqlens"))
    )
    assert want.dtype == torch.float32 and want.abs().max() > 0.1
    torch.testing.assert_close(out, want, atol=5e-7, rtol=1e-6)


def test_tile_overrides_reach_every_c_launch(monkeypatch):
    """--block-v, --warps, --step-warps and --step-maxnreg set the module values the C kernels read at
    launch (the v tile of `block_sizes`, the num_warps of `launch_options`: --warps every chunk kernel's,
    the decode kernels' own warps and register cap); bad values are refused before anything runs."""
    from vexact_vllm.kernels.gated_delta import incremental_tiles_triton as tiles

    bench = _bench("bench_gated_delta_tiles")
    for name in ("BLOCK_V", "WARPS", "KERNEL_WARPS", "ROWS", "STEP_WARPS", "STEP_MAXNREG"):
        monkeypatch.setattr(tiles, name, getattr(tiles, name))
    own = {"rows": tiles.ROWS, "block_v": 64, "warps": 8, "kernel_warps": {"prepare": 4, "output": 4},
           "step_warps": 8, "step_maxnreg": 128}
    assert bench._set_tiles(None, None) == own
    assert tiles.launch_options() == dict(num_warps=8, enable_fp_fusion=False)
    assert tiles.launch_options("prepare") == dict(num_warps=4, enable_fp_fusion=False)
    assert tiles.launch_options(step=True) == dict(num_warps=8, enable_fp_fusion=False, maxnreg=128)
    assert bench._set_tiles(32, 4) == dict(own, block_v=32, warps=4, kernel_warps={}, step_warps=4)
    assert tiles.block_sizes(128, 128) == (128, 128, 32) and tiles.launch_options("output")["num_warps"] == 4
    assert bench._set_tiles(None, 8, 4, 160) == dict(own, block_v=32, kernel_warps={}, step_warps=4, step_maxnreg=160)
    assert tiles.launch_options("prepare") == dict(num_warps=8, enable_fp_fusion=False)  # the chunk kernels keep theirs
    assert tiles.launch_options(step=True) == dict(num_warps=4, enable_fp_fusion=False, maxnreg=160)
    for args in ((48, None), (8, None), (None, 3), (None, None, 5), (None, None, None, 300)):
        with pytest.raises(SystemExit, match="--block-v|--warps|--step-warps|--step-maxnreg"):
            bench._set_tiles(*args)


def test_smoke_run_reports_its_tiles(smoke_run):
    _, report, _ = smoke_run
    assert report["tiles"] == {"rows": 16, "block_v": 64, "warps": 8, "kernel_warps": {"prepare": 4, "output": 4},
                               "step_warps": 8, "step_maxnreg": 128}  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_ops_and_dtype(tmp_path, dtype):
    """--ops N: each timed case's N ops with the most time a call, largest first, printed and in the
    JSON rows; --dtype: the inputs' dtype, recorded in the report."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)  # the torch path: quick
    cmd = [sys.executable, str(SCRIPT), "--small", "--systems", "C", "--train", "", "--prefill", "", "--decode", "3",
           "--no-check", "--ops", "3", "--dtype", dtype, "--output", str(tmp_path / "r.json")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["dtype"] == dtype and f"v heads [4], {dtype}," in done.stdout
    rows = [r for r in report["rows"] if r["case"] == "decode"]
    assert [r["system"] for r in rows] == ["C@0", "C@31", "C@63"]
    for r in rows:
        ms = [op["ms"] for op in r["ops"]]
        assert 0 < len(ms) <= 3 and ms == sorted(ms, reverse=True) and ms[0] > 0, r["ops"]
        assert f"decode hv 4 3 {r['system']}: the ops with the most device time a call" in done.stdout


def test_negative_ops_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--ops", "-2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--ops takes a number of ops" in done.stderr
