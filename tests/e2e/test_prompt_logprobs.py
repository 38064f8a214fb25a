"""`vexact-vllm check --prompt-logprobs K` end to end: every prompt token vLLM scores (its log-prob,
the top K and the ranks) equals the trainer's at temperature 1, in the compositions where prompts are
scored under different schedules (batched, chunked prefill, preemption, beside prefix-cache hits)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vexact_vllm.cli import main
from vexact_vllm.cli.check import read_prompts, tokenize

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

COMPOSITIONS = ("batch", "chunked-prefill", "preemption", "prefix-cache")


def check_prompt_logprobs(tiny_model, tmp_path, arch: str, k: int) -> None:
    """`check --prompt-logprobs k` on the tiny `arch` in COMPOSITIONS: PASS, one prompt row per
    composition, each counting exactly the positions scored, 0 mismatching."""
    out = tmp_path / "report.json"
    rc = main([
        "check", "--model", tiny_model(arch), "--num-prompts", "4", "--max-tokens", "6",
        "--compositions", ",".join(COMPOSITIONS), "--prompt-logprobs", str(k), "--micro-batches", "1,0",
        "--json", "--output", str(out), "--quiet",
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0 and report["passed"] is True, report
    assert report["prompt_logprobs"] == k
    prompt_rows = [r for r in report["rows"] if f"prompt log-probs (top {k})" in r["composition"]]
    sampled_rows = [r for r in report["rows"] if r not in prompt_rows]
    assert sorted(r["composition"].split(" ")[0] for r in sampled_rows) == sorted(COMPOSITIONS)
    assert len(prompt_rows) == len(COMPOSITIONS)
    # Positions scored: P - 1 per prompt of P tokens; prefix-cache scores prefix + prompt twice (the
    # first requests and their repeats; the continued ones do not ask).
    scored = sum(len(p) - 1 for p in tokenize(tiny_model(arch), read_prompts(None, 4), 10**6, 6))
    for row in prompt_rows:
        assert row["mismatches"] == 0, row
        name = row["composition"]
        if name.startswith("prefix-cache"):
            prefix = int(re.search(r"\((\d+)-token prefix\)", name).group(1))
            assert prefix > 0 and row["tokens"] == 2 * (4 * prefix + scored), row
        else:
            assert row["tokens"] == scored, row


def test_prompt_logprobs_equal_the_trainers_in_every_composition(tiny_model, tmp_path):
    check_prompt_logprobs(tiny_model, tmp_path, "qwen3", 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("arch", "k"), [("qwen3", 0), ("qwen3", 5), ("qwen3_moe", 5)])
def test_runner_v2_prompt_logprobs_equal_the_trainers(tiny_model, tmp_path, arch, k):
    """The GPU's model runner v2 (prompt_logprobs.py's patch row): the same check."""
    check_prompt_logprobs(tiny_model, tmp_path, arch, k)
