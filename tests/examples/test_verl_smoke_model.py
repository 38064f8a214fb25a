"""The one-GPU smoke takes MODEL, a built-in name (tiny-qwen3 unless set), and builds that checkpoint in the
cache: `MODEL=tiny-deepseek-v3 bash examples/verl/smoke_1gpu.sh` runs both sides on the tiny DeepSeek-V3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.test_verl_recipe import EXAMPLES, compose

pytest.importorskip("verl")


def test_smoke_builds_the_named_builtin(tmp_path):
    """(Without MODEL the tiny Qwen3: test_verl_smoke.py passes MODEL_PATH, which wins over MODEL.)"""
    env = {**os.environ, "DRY_RUN": "1", "WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
           "VEXACT_VLLM_CACHE": str(tmp_path / "cache")}  # fmt: skip
    env.pop("MODEL_PATH", None)
    env["MODEL"] = "tiny-deepseek-v3"
    subprocess.run(["bash", str(EXAMPLES / "smoke_1gpu.sh")], env=env, check=True, capture_output=True)
    for vexact in ("1", "0"):
        cfg = compose((tmp_path / "work" / "logs" / f"vexact{vexact}.log").read_text().splitlines())
        path = Path(cfg.actor_rollout_ref.model.path)
        assert path.parent == tmp_path / "cache"
        assert json.loads((path / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
