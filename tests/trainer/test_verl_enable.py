"""The training side turns on in verl's processes: through the `verl.plugins` entry point on
`import verl`, and through `actor_rollout_ref.model.external_lib` (verl's `import_external_libs`).
Each case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("verl")

_STATE = """
from vexact_vllm.model_patches import training, verl_hooks
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
wrapped = hasattr(FSDPEngineWithLMHead.__dict__["prepare_model_inputs"], "__wrapped__")
print("STATE", training.is_training_enabled(), verl_hooks.is_installed(), wrapped)
"""


def _run(code: str, **env) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("STATE")][-1]


def test_entry_point_is_installed():
    names = {ep.value for ep in entry_points(group="verl.plugins")}
    assert "vexact_vllm.model_patches.enable" in names, (
        "reinstall the project (pip install --no-deps --no-build-isolation -e .) to register the entry point"
    )


def test_import_verl_turns_the_hooks_on():
    assert _run("import verl\n" + _STATE) == "STATE True True True"


def test_external_lib_turns_the_hooks_on():
    code = (
        "import verl\n"
        "from vexact_vllm.model_patches import verl_hooks\n"
        "assert not verl_hooks.is_installed()  # plugins off: nothing yet\n"
        "from verl.utils.import_utils import import_external_libs\n"
        "import_external_libs('vexact_vllm.model_patches.enable')\n" + _STATE
    )
    assert _run(code, VERL_USE_EXTERNAL_PLUGINS="none") == "STATE True True True"
