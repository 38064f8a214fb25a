"""The README works as written.

- The quickstart's lines are what CI runs: .ci/run installs with the README's install line, takes the
  README's one pytest line by its own grep, and runs `vexact-vllm check`.
- The CPU serve block runs as written, on a loopback port: its serve line (MODEL from the README's own
  MODEL line: the built-in tiny Qwen3) starts the server in the background, its `until` line waits
  for it, its curl request gets log-probs and the sampled ids, and its kill line stops it.
- The offline line names the example tests/examples/test_offline.py runs.
- The training snippet runs as written (its `prompt, response` line given a rollout the server just
  sampled), and the log-probs it picks out for the response equal, as torch.equal, the log-probs the
  server returned for those tokens.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
VENV_PYTHON = ".venv/bin/python"
FIRST_SCREEN = 40  # lines


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _shell_lines(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def _readme_line(prefix: str) -> str:
    lines = [line for block in _blocks("bash") for line in _shell_lines(block) if line.startswith(prefix)]
    assert len(lines) == 1, f"the README should have one line starting {prefix!r}, has {len(lines)}"
    return lines[0]


def _ci_test_pattern() -> str:
    """The pattern .ci/run's grep takes the test command from the README with."""
    match = re.search(r"grep -m1 -o '([^']+)' README\.md", CI.read_text())
    assert match, ".ci/run no longer takes its test command from the README with grep"
    return match.group(1)


def test_one_test_command_and_it_is_in_the_quickstart():
    pattern = _ci_test_pattern()
    matches = [m.group(0) for line in README.read_text().splitlines() if (m := re.search(pattern, line))]
    assert len(matches) == 1, f"README.md must have exactly one line matching .ci/run's {pattern!r}"
    quickstart = _shell_lines(_blocks("bash")[0])
    assert len(quickstart) == 2, quickstart
    install, test = (part.strip() for part in quickstart[1].split("&&"))
    assert test == matches[0]
    assert test.startswith(f"{VENV_PYTHON} -m pytest ")


def test_ci_installs_and_checks_as_the_quickstart_says():
    ci = [line.strip() for line in CI.read_text().splitlines()]
    check_line, test_line = _shell_lines(_blocks("bash")[0])
    user_install, check = (part.strip() for part in check_line.split("&&"))
    dev_install, _ = (part.strip() for part in test_line.split("&&"))
    assert user_install == "bash scripts/install-cpu.sh"
    assert check == ".venv/bin/vexact-vllm check"
    assert dev_install in ci, f".ci/run must install as the README's test line does ({dev_install})"
    assert any(line.startswith("vexact-vllm check") for line in ci), ".ci/run must run vexact-vllm check"


def test_quickstart_is_in_the_first_screen():
    lines = README.read_text().splitlines()
    for needle in ("bash scripts/install-cpu.sh && .venv/bin/vexact-vllm check", 'pip install -e ".[gpu]"',
                   "vllm serve MODEL --model-impl vexact"):  # fmt: skip
        where = next(i for i, line in enumerate(lines) if needle in line)
        assert where < FIRST_SCREEN, f"{needle!r} at line {where + 1}"
    assert not re.search(r"pip install\s+[\"']?vexact-vllm", README.read_text()), "the package is not on PyPI"


def _with_this_python(line: str) -> str:
    """The README's `.venv/bin/python` as the interpreter running the tests (the same venv on CI)."""
    assert line.startswith(VENV_PYTHON) or f"$({VENV_PYTHON}" in line, line
    return line.replace(VENV_PYTHON, shlex.quote(sys.executable))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's CPU serve line, MODEL from the README's MODEL line, on a loopback port."""
    import requests

    model_line = _readme_line("MODEL=")
    model = subprocess.run(
        ["bash", "-c", _with_this_python(model_line) + '\nprintf %s "$MODEL"'], cwd=ROOT, check=True,
        capture_output=True, text=True, timeout=600,
    ).stdout  # fmt: skip
    assert Path(model, "config.json").is_file(), model
    serve = _with_this_python(_readme_line(f"{VENV_PYTHON} -m vllm.entrypoints.openai.api_server"))
    assert serve.endswith(" &"), "the serve line runs the server in the background, as a script would"
    serve = serve.removesuffix(" &")
    assert "--kv-cache-memory-bytes" in serve or "--gpu-memory-utilization" in serve
    assert _readme_line("SERVER=") == "SERVER=$!"  # the background server's pid, for the kill line
    port = _free_port()
    argv = [a.replace("$MODEL", model) for a in shlex.split(serve)] + ["--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path_factory.mktemp("readme-server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the README's serve line exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                pytest.fail(f"server not ready after 600 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base, port, model
        kill = _readme_line("kill ")
        subprocess.run(["bash", "-c", kill], env={**os.environ, "SERVER": str(proc.pid)}, check=True, timeout=30)
        assert proc.wait(60) is not None  # the README's kill line stops the server
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.vllm
@pytest.mark.slow
def test_cpu_serve_line_answers_with_logprobs(readme_server):
    import json

    import requests

    base, port, model = readme_server
    wait, curl = (_readme_line(p).replace("localhost:8000", f"127.0.0.1:{port}") for p in ("until ", "curl "))
    if shutil.which("curl"):
        subprocess.run(["bash", "-c", wait], check=True, capture_output=True, timeout=120)  # up already: returns
        out = subprocess.run(["bash", "-c", curl], env={**os.environ, "MODEL": model}, check=True,
                             capture_output=True, text=True, timeout=120).stdout  # fmt: skip
        answer = json.loads(out)
    else:  # the same request without curl
        body = {"model": model, "prompt": "1 + 1 =", "max_tokens": 8, "logprobs": 0, "seed": 1, "return_token_ids": True}
        answer = requests.post(f"{base}/v1/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    assert 0 < len(logprobs["token_logprobs"]) <= 8
    assert all(isinstance(x, float) and x <= 0.0 for x in logprobs["token_logprobs"])
    # the sampled ids, as the README says: "return_token_ids" fills token_ids (and prompt_token_ids)
    assert len(choice["token_ids"]) == len(logprobs["token_logprobs"]) and all(isinstance(t, int) for t in choice["token_ids"])
    assert choice["prompt_token_ids"] and all(isinstance(t, int) for t in choice["prompt_token_ids"])


def _rollout(base: str, model: str) -> tuple[list[int], list[int], list[float]]:
    import requests
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model)("The capital of France is")["input_ids"]
    body = {
        "model": model, "prompt": prompt, "max_tokens": 10, "temperature": 1.0, "seed": 7, "logprobs": 0,
        "ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    r = requests.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    # the README's two ways to the sampled ids agree
    assert choice["token_ids"] == [int(t.removeprefix("token_id:")) for t in lp["tokens"]], (choice["token_ids"], lp["tokens"])
    assert choice["prompt_token_ids"] == prompt
    return prompt, choice["token_ids"], [float(x) for x in lp["token_logprobs"]]


@pytest.mark.vllm
@pytest.mark.slow
def test_training_snippet_equals_served_logprobs(readme_server):
    import torch

    base, _, model = readme_server
    prompt, response, served = _rollout(base, model)
    (snippet,) = _blocks("python")
    assignment = re.compile(r"^prompt, response = .*$", re.M)
    assert len(assignment.findall(snippet)) == 1, "the snippet should set `prompt, response` on one line"
    code = assignment.sub(f"prompt, response = {prompt!r}, {response!r}", snippet)
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(code, "README.md (training snippet)", "exec"), namespace)
    assert str(namespace["path"]) == model  # the snippet scores the checkpoint the server served
    logp = namespace["logp"]
    assert logp.dtype == torch.float32 and logp.shape == (len(prompt) + len(response),)
    response_logp = namespace["response_logp"].detach()
    assert response_logp.shape == (len(response),)
    assert torch.equal(response_logp, torch.tensor(served, dtype=torch.float32))


def test_offline_line_runs_the_example():
    """The README's offline line runs examples/offline.py, which tests/examples/test_offline.py runs."""
    line = _readme_line(f"{VENV_PYTHON} examples/offline.py")
    assert line == f"{VENV_PYTHON} examples/offline.py" and (ROOT / "examples" / "offline.py").is_file()
