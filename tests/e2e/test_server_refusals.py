"""The OpenAI server refuses unsupported engine options in its front-end process: it exits with the
message before any engine process starts (the configuration hook of engine_checks.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from vexact_vllm import MODEL_IMPL

from .test_server import server_command

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize(
    ("case", "args", "message"),
    [
        ("float16_checkpoint", [], "dtype torch.float16 is not supported by vexact-vllm"),
        ("fp8_kv_cache", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 cannot keep"),
    ],
)
def test_server_exits_in_the_front_end(tiny_model, tmp_path, case, args, message):
    model = tmp_path / "fp16"
    shutil.copytree(tiny_model("qwen3"), model)
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "float16"
    (model / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [*server_command(), str(model), "--model-impl", MODEL_IMPL, "--host", "127.0.0.1", "--port", "0", *args],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert message in output, output[-4000:]
    assert "EngineCore" not in output  # no engine process was started
