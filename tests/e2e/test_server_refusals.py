"""The OpenAI server's refusals of engine options, where a user meets them: the server exits in its
front-end process with the message, before any engine process starts (option_policy.py through the
patched `EngineArgs.create_engine_config`, and the configuration hook of engine_checks.py). A running
server's answers to request options it refuses or honours: test_server.py (on that module's server).
"""

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
    ("case", "args", "env", "message"),
    [
        ("float16_checkpoint", [], {}, "dtype torch.float16 is not supported by vexact-vllm"),
        ("fp8_kv_cache", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8"], {}, "--kv-cache-dtype fp8 cannot keep"),
        ("prompt_embeds", ["--dtype", "bfloat16", "--enable-prompt-embeds"], {},
         "--enable-prompt-embeds is not supported with --model-impl vexact"),
        ("logits_mode", ["--dtype", "bfloat16", "--logprobs-mode", "processed_logits"], {},
         "--logprobs-mode processed_logits is not supported with --model-impl vexact"),
        ("batch_invariant", ["--dtype", "bfloat16"], {"VLLM_BATCH_INVARIANT": "1"},
         "VLLM_BATCH_INVARIANT=1 is not supported with --model-impl vexact: vexact models are batch-invariant"),
    ],
)  # fmt: skip
def test_server_exits_in_the_front_end(tiny_model, tmp_path, case, args, env, message):
    model = tmp_path / "fp16"
    shutil.copytree(tiny_model("qwen3"), model)
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "float16"
    (model / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [*server_command(), str(model), "--model-impl", MODEL_IMPL, "--host", "127.0.0.1", "--port", "0", *args],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert message in output, output[-4000:]
    assert "EngineCore" not in output  # no engine process was started
