"""benchmarks/bench_gated_delta.py end to end on the CPU (--small, the Triton interpreter): both designs'
decode == training check, every case timed or skipped with its reason, the JSON report and the
docs/results.jsonl rows (valid for scripts/results_page.py). The GPU-only arithmetic (B's estimated
backward, the ratios) on synthetic rows."""

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


def test_smoke_run_checks_and_times_every_design(smoke_run):
    stdout, report, _ = smoke_run
    rows = report["rows"]
    checks = {r["system"]: r for r in rows if r["case"] == "check"}
    assert set(checks) == {"A", "B", "C"}
    assert all(r["decode_equals_training"] and r["first_difference"] is None for r in checks.values())
    by = {(r["case"], r["system"]): r for r in rows if r["case"] != "check"}
    assert by[("train", "A")]["fwd_ms"] > 0 and by[("train", "A")]["fwd_bwd_ms"] > 0
    assert by[("train", "B")]["fwd_ms"] > 0 and "fwd_bwd_ms" not in by[("train", "B")]
    assert by[("train", "C")]["fwd_ms"] > 0 and by[("train", "C")]["fwd_bwd_ms"] > 0
    for case in ("train", "prefill", "decode"):
        assert by[(case, "A")]["fwd_vs_a"] == 1.0 and by[(case, "A")]["max_abs_diff_vs_a"] == 0.0
    for case in ("train", "prefill"):  # the designs compute one function: close, not equal (bf16 dots)
        assert all(0 < by[(case, d)]["max_abs_diff_vs_a"] < 0.05 for d in ("B", "C"))
    assert all(by[("decode", f"{d}@{p}")]["fwd_ms"] > 0 for d in ("B", "C") for p in (0, 31, 63))
    for name in ("fla-chunk", "vllm-chunk", "fla-recurrent", "vllm-decode"):
        case = "decode" if name in ("fla-recurrent", "vllm-decode") else "train"
        assert by[(case, name)]["skipped"] == "needs CUDA"
    assert not any("error" in r for r in rows)
    assert "decode == training" in stdout and "Triton interpreter" in stdout


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
    assert rows[3]["value"].startswith("PASS: A at 4 v heads: equal; B at 4 v heads: equal")
    assert "Absent baselines: fla-chunk, fla-recurrent, vllm-chunk, vllm-decode" in rows[0]["notes"]
    assert rows[0]["commit"] == report["environment"]["commit"][:7]
    page.render(rows)


def test_b_backward_estimate_and_gpu_rows():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        bench = _load(SCRIPT, "bench_gated_delta_for_test")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def row(system, fwd, fwd_bwd=None):
        r = {"case": "train", "v_heads": 32, "size": "8192x2048", "system": system, "fwd_ms": fwd}
        return r if fwd_bwd is None else {**r, "fwd_bwd_ms": fwd_bwd}

    rows = [row("A", 10.0, 40.0), row("B", 2.0), row("fla-chunk", 1.5, 5.5), row("vllm-chunk", 1.6)]
    rows.append({"case": "train", "v_heads": 48, "size": "8192x2048", "system": "B", "fwd_ms": 3.0})  # no fla
    bench._estimate_b_backward(rows)
    assert rows[1]["fwd_bwd_est_ms"] == 6.0 and rows[1]["fwd_bwd_est_vs_a"] == 6.0 / 40.0
    assert "fwd_bwd_est_ms" not in rows[4] and "fwd_bwd_est_ms" not in rows[3]
    env = {"date": "2026-01-01T00:00:00+00:00", "device": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
           "fla": None, "vllm": "0.26.0", "commit": "0123456789", "command": "python bench"}  # fmt: skip
    out = bench.results_rows({"environment": env, "shape": bench.FULL, "rows": rows})
    assert [r["id"] for r in out] == ["gdn-train-h200"]  # no prefill, decode or check rows to report
    assert "B 2.00 / ~6.00" in out[0]["value"] and "A 10.00 / 40.00" in out[0]["value"]
    assert "fla absent" in out[0]["device"] and out[0]["commit"] == "0123456"
    assert "~" in bench.table(rows)


def test_chunked_baseline_adapter_matches_design_a():
    """_fla_chunk_run's conventions (gates as transformers computes them, q, k repeated over the v heads
    for a kernel refusing GQA, the [1, T, ...] batch, one kernel call a run) on a stand-in kernel that
    runs transformers' Qwen3-Next recurrence per sequence: its output is design A's to rounding."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        bench = _load(SCRIPT, "bench_gated_delta_for_adapter")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
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
    from vexact_vllm.kernels.gated_delta.recurrent import gated_delta_rule_torch

    want, _ = gated_delta_rule_torch(
        *(x[k] for k in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "cu_seqlens"))
    )
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
