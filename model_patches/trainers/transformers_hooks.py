"""transformers side of the training switch: `AutoModelForCausalLM` builds the vexact training class
(hf_causal_lm.py) for every supported config, which is how verl's FSDP engine (and VeOmni under
`MODELING_BACKEND=hf`) build models. Symmetric and idempotent: `install()`, `uninstall()`,
`is_installed()` and the `installed()` context manager, the API of verl_hooks and veomni_hooks;
`switch.enable()` installs all three.

`uninstall()` removes only the entries that are vexact classes: a class someone else registered for
the same config since stays registered.

vLLM 0.26 registers its own copies of some configs with AutoConfig (Qwen3-Next's, Qwen3.5's) when it
reads such a checkpoint; AutoModel would then find no entry for the copy and fall back, by class name,
to transformers' own model class. So in a process where vLLM runs (verl's colocated workers, the
check) the training classes are registered for vLLM's copies too: `install()` reads vLLM's config
registry where vLLM has loaded it, and the vLLM plugin (`vexact_vllm.register`) installs again once
vLLM loads, for a switch enabled before.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from transformers import AutoModelForCausalLM

from .hf_causal_lm import TRAINING_CLASSES

_installed = False

VLLM_CONFIG_MODULE = "vllm.transformers_utils.config"  # its _CONFIG_REGISTRY: model_type -> vLLM's config


def _mapping() -> dict:
    return AutoModelForCausalLM._model_mapping._extra_content


def vllm_config_copies() -> dict[str, type]:
    """model_type -> vLLM's own config class, for the training classes' model types vLLM keeps a copy
    of; empty where vLLM's config module is not loaded (importing it costs seconds: a trainer without
    vLLM never meets the copies)."""
    registry = getattr(sys.modules.get(VLLM_CONFIG_MODULE), "_CONFIG_REGISTRY", None) or {}
    return {t: registry[t] for t in TRAINING_CLASSES if t in registry}


def install() -> None:
    """After this, AutoModelForCausalLM.from_pretrained / from_config on a supported config returns
    the vexact training class (a PreTrainedModel), for vLLM's copy of the config too (module docstring)."""
    global _installed
    copies = vllm_config_copies()
    for model_type, cls in TRAINING_CLASSES.items():
        for config_class in (cls.config_class, copies.get(model_type)):
            if config_class is None:
                continue
            AutoModelForCausalLM.register(config_class, cls, exist_ok=True)
            # Some transformers releases skip registrations keyed by their own config classes (their
            # guard against remote code); put the entry in the registry's own table for them.
            _mapping()[config_class] = cls
    _installed = True


def uninstall() -> None:
    global _installed
    ours = set(TRAINING_CLASSES.values())
    for config_class, cls in list(_mapping().items()):
        if cls in ours:
            del _mapping()[config_class]
    _installed = False


def is_installed() -> bool:
    return _installed


@contextmanager
def installed():
    """Installed within the block; the previous state afterwards (installed again if the body
    uninstalled what was installed before it)."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        (install if was else uninstall)()
