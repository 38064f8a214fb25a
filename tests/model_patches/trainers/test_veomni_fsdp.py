"""verl's `model_engine=veomni` with FSDP on, as on two GPUs, but on two CPU processes (gloo):
VeOmni shards the shared model over both ranks (meta-device init, rank 0 loads and broadcasts, FSDP2
with its bf16-over-fp32 mixed precision and `cast_forward_inputs`), and each rank's log-probs of the
rollouts are torch.equal to what vLLM returned. With one rank VeOmni turns FSDP off
(test_veomni_engine.py covers that path); this is the path of a verl run on two GPUs, where
`cast_forward_inputs` would cast an fp32 RoPE table passed to a layer to bf16 (so no layer takes it
as an argument)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("veomni")
pytest.importorskip("verl")

from .veomni_cpu import free_port  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_two_rank_fsdp_engine_log_probs_equal_vllm(tiny_model, masked_rollouts_of, tmp_path, arch):
    """The tiny Qwen3-MoE: its layers hold both block kinds (three MoE, one dense MLP), and every
    layer's attention takes the RoPE table; the tiny DeepSeek-V3: MLA, shared experts and the router's
    fp32 correction bias (a buffer: each rank checks it holds the checkpoint's values in fp32)."""
    rollouts = masked_rollouts_of(arch)
    case = tmp_path / "case.pkl"
    case.write_bytes(
        pickle.dumps({"model": str(tiny_model(arch)), "rollouts": {t: rs[:4] for t, rs in rollouts.items()}})
    )
    script = Path(__file__).with_name("veomni_fsdp_rank.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(case), str(free_port())],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"a rank failed:\n{proc.stderr[-6000:]}"
