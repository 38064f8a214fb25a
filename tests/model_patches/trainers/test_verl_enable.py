"""The training side is off until asked for: installing vexact-vllm registers no `verl.plugins` entry
point, so a fresh `import verl` changes nothing; `actor_rollout_ref.model.external_lib` (verl's
`import_external_libs`) or `enable()` turns it on, and `disable()` off again. Each case runs in a fresh
interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("verl")

_STATE = """
from vexact_vllm.model_patches.trainers import transformers_hooks, verl_hooks
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
wrapped = hasattr(FSDPEngineWithLMHead.__dict__["prepare_model_inputs"], "__wrapped__")
print("STATE", transformers_hooks.is_installed(), verl_hooks.is_installed(), wrapped)
"""


def _run(code: str, **env) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("STATE")][-1]


def test_no_verl_plugin_entry_point():
    names = {ep.value for ep in entry_points(group="verl.plugins")}
    assert not any(name.startswith("vexact_vllm") for name in names), (
        "reinstall the project (pip install --no-deps -e .) to drop the old verl.plugins entry point"
    )


def test_import_verl_changes_nothing():
    assert _run("import verl\n" + _STATE) == "STATE False False False"


def test_external_lib_turns_the_hooks_on():
    code = (
        "import verl\n"
        "from vexact_vllm.model_patches.trainers import verl_hooks\n"
        "assert not verl_hooks.is_installed()\n"
        "from verl.utils.import_utils import import_external_libs\n"
        "import_external_libs('vexact_vllm.model_patches.enable')\n" + _STATE
    )
    assert _run(code) == "STATE True True True"


def test_enable_and_disable_are_symmetric():
    code = (
        "import vexact_vllm.model_patches.enable as switch\n"  # importing it is the switch
        "assert switch.is_enabled()\n"
        "switch.disable()\n"
        "assert not switch.is_enabled()\n"
        "with switch.enabled():\n"
        "    assert switch.is_enabled()\n"
        "assert not switch.is_enabled()\n"
        "from vexact_vllm.model_patches import enable\n"  # the module by now: callable like the function
        "enable()\n" + _STATE
    )
    assert _run(code) == "STATE True True True"
