"""The check's arguments are refused while parsing, with a message, before any engine starts."""

from __future__ import annotations

import pytest
import torch

from vexact_vllm.cli import main
from vexact_vllm.cli.report import Row, to_json, to_table
from vexact_vllm.cli.rollout import Rollout
from vexact_vllm.cli.score import compare


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts: must be at least 1"),
        (["--max-tokens", "0"], "--max-tokens: must be at least 1"),
        (["--max-tokens", "ten"], "'ten' is not an integer"),
        (["--temperature", "-1"], "--temperature: must be between 0"),
        (["--temperature", "nan"], "--temperature: must be between 0"),
        (["--prompts", "/no/such/prompts.txt"], "no such file"),
        (["--micro-batches", "x"], "not a comma-separated list"),
        (["--micro-batches", "1,-2"], "sizes >= 0"),
        (["--max-model-len", "0"], "--max-model-len: must be at least 1"),
        (["--prompt-logprobs", "21"], "--prompt-logprobs: must be between 0 and 20"),
        (["--prompt-logprobs", "-1"], "--prompt-logprobs: must be between 0 and 20"),
    ],
)
def test_bad_arguments_are_refused_while_parsing(argv, message, capsys, monkeypatch):
    from vexact_vllm.cli import check

    def no_engine(*args, **kwargs):  # parsing must fail first
        raise AssertionError("the check started before its arguments were validated")

    monkeypatch.setattr(check, "_run", no_engine)
    with pytest.raises(SystemExit) as exc:
        main(["check", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_packings_that_disagree_are_shown_one_by_one():
    rollouts = [Rollout([1, 2], [3, 4], [-1.0, -2.0])]
    bad = compare(rollouts, [torch.tensor([-1.0, -2.5])])
    row = Row("batch", "vexact", "1,all", bad, per_packing={"1": 0, "all": 1})
    assert "1:0,all:1" in to_table([row])
    agreeing = Row("batch", "vexact", "1,all", bad, per_packing={"1": 1, "all": 1})
    assert "1,all" in to_table([agreeing]) and "1:1" not in to_table([agreeing])
    assert '"per_packing": {' in to_json([row], {})
