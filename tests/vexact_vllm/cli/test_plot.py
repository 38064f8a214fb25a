"""`check --plot`: a PNG with vexact beside stock, exact zeros on a floor below every difference."""

from __future__ import annotations

import pytest
import torch

from vexact_vllm.cli.plot import zero_floor
from vexact_vllm.cli.report import Row
from vexact_vllm.cli.rollout import Rollout
from vexact_vllm.cli.score import compare


def _rows():
    rollouts = [Rollout([1, 2], [3, 4, 5], [-1.0, -2.0, -3.0])]
    exact = compare(rollouts, [torch.tensor([-1.0, -2.0, -3.0])])
    off = compare(rollouts, [torch.tensor([-1.0 + 3e-6, -2.0 - 0.01, -3.0])])
    return [Row("alone", "vexact", "all", exact), Row("batch", "vexact", "all", exact),
            Row("batch", "stock", "all", off)]  # fmt: skip


def test_zero_floor_is_below_every_difference():
    rows = _rows()
    smallest = min(d for r in rows for _, d in r.comparison.per_position if d > 0)
    assert zero_floor(rows) < smallest / 5 and zero_floor(rows) <= 1e-9
    assert zero_floor(rows[:2]) == 1e-9  # all exact


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from vexact_vllm.cli.plot import plot_differences

    out = tmp_path / "diff.png"
    plot_differences(_rows(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from vexact_vllm.cli.plot import require_matplotlib

    with pytest.raises(SystemExit, match="--plot needs matplotlib"):
        require_matplotlib()
