"""Importing this module turns the training side on (`trainers.switch.enable()`): the module verl's
`actor_rollout_ref.model.external_lib=vexact_vllm.model_patches.enable` imports in its workers.

It re-exports the switch (`from vexact_vllm.model_patches.enable import enable`). Importing it also
binds the package attribute `vexact_vllm.model_patches.enable` to this module, in place of the
function the package exports under that name; so the module is callable too, and
`from vexact_vllm.model_patches import enable; enable()` turns the switch on either way.
"""

from __future__ import annotations

import sys
import types

from .trainers.switch import disable, enable, enabled, is_enabled

__all__ = ["disable", "enable", "enabled", "is_enabled"]


class _SwitchModule(types.ModuleType):
    def __call__(self) -> None:
        enable()


sys.modules[__name__].__class__ = _SwitchModule
enable()
