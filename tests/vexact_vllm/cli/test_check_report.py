"""The check's comparison and report: a mismatch is counted and located, never hidden."""

from __future__ import annotations

import json

import torch

from vexact_vllm.cli.report import Row, to_json, to_table, verdict
from vexact_vllm.cli.rollout import Rollout
from vexact_vllm.cli.score import compare


def _rollouts():
    return [Rollout([1, 2, 3], [4, 5], [-1.5, -2.25]), Rollout([7], [8, 9, 10], [-0.5, -3.0, -4.0])]


def test_equal_values_pass():
    trainer = [torch.tensor([-1.5, -2.25]), torch.tensor([-0.5, -3.0, -4.0])]
    c = compare(_rollouts(), trainer)
    assert (c.tokens, c.mismatches, c.max_abs_diff, c.first) == (5, 0, 0.0, None)
    assert verdict([Row("batch", "vexact", "all", c)])


def test_one_ulp_is_a_mismatch_and_is_located():
    off = torch.nextafter(torch.tensor(-3.0), torch.tensor(0.0))  # one fp32 ulp
    trainer = [torch.tensor([-1.5, -2.25]), torch.tensor([-0.5, float(off), -4.0])]
    c = compare(_rollouts(), trainer)
    assert c.mismatches == 1
    assert (c.first.request, c.first.position, c.first.output_index) == (1, 2, 1)  # prompt length 1 + output index 1
    assert c.first.vllm == -3.0 and c.first.trainer == float(off)
    rows = [Row("batch", "vexact", "all", c), Row("batch", "stock", "all", compare(_rollouts(), trainer))]
    assert not verdict(rows)
    table = to_table(rows)
    assert "request 1, generated token 1 (position 2 counting the prompt)" in table and "FAIL" in table
    report = json.loads(to_json(rows, {"model": "m"}))
    assert report["passed"] is False and report["rows"][0]["mismatches"] == 1


def test_stock_rows_do_not_decide():
    trainer = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.5, -3.0, -4.0])]
    good = compare(_rollouts(), [torch.tensor([-1.5, -2.25]), torch.tensor([-0.5, -3.0, -4.0])])
    rows = [Row("batch", "vexact", "all", good), Row("batch", "stock", "all", compare(_rollouts(), trainer))]
    assert verdict(rows)
    assert not verdict([rows[1]])  # no vexact row: no verdict of success
