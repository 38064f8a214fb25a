"""transformers side of the training switch: `AutoModelForCausalLM` builds the vexact training class
(hf_causal_lm.py) for every supported config, which is how verl's FSDP engine (and VeOmni under
`MODELING_BACKEND=hf`) build models. Symmetric and idempotent: `install()`, `uninstall()`,
`is_installed()` and the `installed()` context manager, the API of verl_hooks and veomni_hooks;
`switch.enable()` installs all three.

`uninstall()` removes only the entries that are vexact classes: a class someone else registered for
the same config since stays registered.
"""

from __future__ import annotations

from contextlib import contextmanager

from transformers import AutoModelForCausalLM

from .hf_causal_lm import TRAINING_CLASSES

_installed = False


def _mapping() -> dict:
    return AutoModelForCausalLM._model_mapping._extra_content


def install() -> None:
    """After this, AutoModelForCausalLM.from_pretrained / from_config on a supported config returns
    the vexact training class (a PreTrainedModel)."""
    global _installed
    for cls in TRAINING_CLASSES.values():
        AutoModelForCausalLM.register(cls.config_class, cls, exist_ok=True)
        # Some transformers releases skip registrations keyed by their own config classes (their
        # guard against remote code); put the entry in the registry's own table for them.
        _mapping()[cls.config_class] = cls
    _installed = True


def uninstall() -> None:
    global _installed
    for cls in TRAINING_CLASSES.values():
        if _mapping().get(cls.config_class) is cls:
            del _mapping()[cls.config_class]
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
