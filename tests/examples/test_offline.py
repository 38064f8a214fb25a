"""examples/offline.py runs as a user runs it (its own process, `python examples/offline.py`): vLLM
generates, the trainer scores the same tokens, and the script's last line says torch.equal is True."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "offline.py"

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_offline_example_prints_equal_log_probs(tiny_model):
    # On CPU the test session runs vLLM's engine in the script's process (tests/conftest.py); the bits
    # are the same in vLLM's default layout.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_model("qwen3"), "--max-tokens", "6", "--seed", "3"],
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[-1] == "torch.equal(vLLM, trainer): True", lines
    rows = lines[lines.index(next(line for line in lines if line.lstrip().startswith("token id"))) + 1 : -1]
    assert len(rows) == 6 and not any("differs" in row for row in rows), rows
    assert all(float(row.split()[1]) == float(row.split()[2]) <= 0.0 for row in rows), rows
