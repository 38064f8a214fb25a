"""benchmarks/profile_steps.py on hand-written torch-profiler traces: every GPU event in one category,
per-step sums, the difference to the base configuration, gzipped and plain traces, clear errors."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def prof(load_script):
    return load_script("profile_steps")


STOCK = {  # kernel name -> its category, names as stock vLLM's and ours appear in traces
    "void flash::FlashAttnFwdSm90<cutlass::arch::Sm90, 128>(Params)": "attention",
    "void flash::FlashAttnFwdCombine<256>(Params)": "attention",
    "nvjet_tst_128x64_64x8_2x1_v_bz_coopA_NNT": "gemm",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>(...)": "kv write",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "triton_poi_fused_mul_silu_slice_1": "silu-and-mul",
    "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)": "rope",
    "Memcpy HtoD (Pageable -> Device)": "copy/fill",
    "void at::native::vectorized_elementwise_kernel<4, at::native::exponential_kernel>(...)": "sampler",
    "some_kernel_nobody_named": "other",
}
VEXACT = {
    "_paged_fwd_kernel": "attention",
    "_fold_kernel": "attention",
    "_linear_kernel": "gemm",
    "_write_kv_kernel": "kv write",
    "_rms_norm_fwd_kernel": "norm",
    "_silu_and_mul_fwd_kernel": "silu-and-mul",
    "_rope_kernel": "rope",
    "chunk_lse_kernel": "sampler",
    "_gumbel_chunk_kernel": "sampler",
    "_gate_up_kernel": "moe",
}


def test_every_name_gets_its_category(prof):
    for name, cat in {**STOCK, **VEXACT}.items():
        assert prof.category(name) == cat, name


def _write_trace(folder: Path, names: dict[str, str], steps: int, rng: random.Random, gz: bool) -> dict:
    """A trace of `steps` steps, each kernel once a step with a random duration, plus CPU events the
    summary must ignore; returns the expected us a step per category."""
    folder.mkdir(parents=True)
    events, expected, ts = [], {}, 1000.0
    for _ in range(steps):
        for name, cat in names.items():
            dur = rng.uniform(1, 50)
            kind = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
            events.append({"ph": "X", "cat": kind, "name": name, "ts": ts, "dur": dur})
            events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": 1e6})
            expected[cat] = expected.get(cat, 0.0) + dur / steps
            ts += dur + 2.0
    body = json.dumps({"traceEvents": events})
    path = folder / ("rank0.123.pt.trace.json" + (".gz" if gz else ""))
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(body)
    else:
        path.write_text(body)
    return expected


def test_per_step_sums_and_differences(prof, tmp_path, capsys):
    rng = random.Random(3)
    steps = rng.randrange(2, 9)
    want_stock = _write_trace(tmp_path / "stock", STOCK, steps, rng, gz=True)
    want_vexact = _write_trace(tmp_path / "vexact", VEXACT, steps, rng, gz=False)
    got_stock = prof.summarise(prof.load_events(str(tmp_path / "stock")), steps)
    got_vexact = prof.summarise(prof.load_events(str(tmp_path / "vexact")), steps)
    for want, got in ((want_stock, got_stock), (want_vexact, got_vexact)):
        assert got["us"].keys() == want.keys()
        for cat in want:
            assert got["us"][cat] == pytest.approx(want[cat])
        assert got["sum"] == pytest.approx(sum(want.values()))
        assert got["span"] > got["sum"]  # the 2 us gaps between kernels count in the span only

    prof.main([str(tmp_path), "--steps", str(steps), "--top", "2"])
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[3:5] == ["stock", "vexact"]  # the base first
    attention = next(line for line in out.splitlines() if line.startswith("attention"))
    diff = float(attention.split()[-1])
    assert diff == pytest.approx(want_vexact["attention"] - want_stock["attention"], abs=0.06)
    assert "_paged_fwd_kernel" in out and "FlashAttnFwdSm90<..>" in out


def test_missing_traces_say_what_to_run(prof, tmp_path):
    (tmp_path / "stock").mkdir()
    with pytest.raises(SystemExit, match="--profile"):
        prof.main([str(tmp_path), "--steps", "4"])
    with pytest.raises(SystemExit, match="no configuration folders"):
        prof.main([str(tmp_path / "stock"), "--steps", "4"])
