"""The OpenAI server's refusals, where a user meets them.

- Engine options: the server exits in its front-end process with the message, before any engine
  process starts (option_policy.py through the patched `EngineArgs.create_engine_config`, and the
  configuration hook of engine_checks.py).
- Request options: a running server answers HTTP 400 naming the option (request_validation.py), and
  keeps serving; the options the vexact sampler honours are served.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import requests

from vexact_vllm import MODEL_IMPL

from .test_server import server, server_command  # noqa: F401  (the module's own server)

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


# option -> the name the 400 must carry (the completions API's fields)
REFUSED_REQUESTS = {
    "thinking_token_budget": ({"thinking_token_budget": 8}, "thinking_token_budget"),
    "watermarking": ({"watermarking": True}, "watermarking"),
    "routed_experts_prompt_start": ({"routed_experts_prompt_start": 2}, "routed_experts_prompt_start"),
    "min_tokens": ({"min_tokens": 2}, "min_tokens"),
    "bad_words": ({"bad_words": ["x"]}, "bad_words"),
    "allowed_token_ids": ({"allowed_token_ids": [1, 2, 3]}, "allowed_token_ids"),
    "logit_bias": ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    "repetition_penalty": ({"repetition_penalty": 1.2}, "repetition_penalty"),
    "frequency_penalty": ({"frequency_penalty": 0.5}, "frequency_penalty"),
}


def _runner_v2() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"


def test_refused_request_options_get_400_naming_them(server):  # noqa: F811
    base, model = server
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "seed": 1}
    refused = dict(REFUSED_REQUESTS)
    # the option one runner serves and the other refuses
    if not _runner_v2():
        refused["logprob_token_ids"] = ({"logprob_token_ids": [4, 5], "logprobs": 0}, "logprob_token_ids")
    for case, (option, name) in refused.items():
        r = requests.post(f"{base}/v1/completions", json={**body, **option}, timeout=60)
        assert r.status_code == 400, (case, r.text)
        assert name in r.text and "--model-impl vexact" in r.text, (case, r.text)


def test_honoured_request_options_are_served(server):  # noqa: F811
    base, model = server
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, "seed": 1, "ignore_eos": True}

    def complete(**option):
        r = requests.post(f"{base}/v1/completions", json={**body, **option}, timeout=60)
        assert r.status_code == 200, (option, r.text)
        return r.json()["choices"]

    assert len(complete(n=2)) == 2
    assert len(complete(logprobs=3)[0]["logprobs"]["token_logprobs"]) == 4
    for option in ({"stop": ["x"]}, {"watermarking": False}, {"top_k": 5, "top_p": 0.9, "min_p": 0.01},
                   {"repetition_detection": {"max_pattern_size": 2, "min_count": 3}}):  # fmt: skip
        complete(**option)
    assert complete(prompt_logprobs=1)[0]["prompt_logprobs"] is not None  # both runners (test_server.py: values)
    if _runner_v2():
        complete(logprob_token_ids=[4, 5], logprobs=0)
