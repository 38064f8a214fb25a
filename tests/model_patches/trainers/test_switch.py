"""The training switch (enable / disable / is_enabled / enabled): AutoModelForCausalLM builds the
vexact classes only while it is on, the installed trainer libraries' hooks go on and off with it, and
it is symmetric and reversible. Also its transformers part alone and the package's exports."""

import importlib
import importlib.util
import sys

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

import vexact_vllm.model_patches as model_patches
from vexact_vllm.model_patches import VexactForCausalLM, disable, enable, enabled, is_enabled
from vexact_vllm.model_patches.trainers import switch, transformers_hooks
from vexact_vllm.model_patches.trainers.hf_causal_lm import TRAINING_CLASSES

STOCK = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}
ARCHS = list(STOCK)


@pytest.fixture(autouse=True)
def _switch_off():
    disable()
    yield
    disable()


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _trainer_hooks():
    """The hooks modules of the trainer libraries installed here (verl, VeOmni)."""
    return [
        importlib.import_module(module)
        for library, module in switch.TRAINER_HOOKS.items()
        if importlib.util.find_spec(library) is not None
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_enable_then_disable(tiny_paths, arch):
    assert not is_enabled()
    assert type(_load(tiny_paths[arch])) is STOCK[arch]
    enable()
    assert is_enabled()
    assert all(hooks.is_installed() for hooks in _trainer_hooks())
    model = _load(tiny_paths[arch])
    assert type(model) is TRAINING_CLASSES[arch] and isinstance(model, VexactForCausalLM)
    assert model.dtype == torch.float32
    config = AutoConfig.from_pretrained(tiny_paths[arch])
    assert type(AutoModelForCausalLM.from_config(config)) is TRAINING_CLASSES[arch]
    disable()
    assert not is_enabled()
    assert not any(hooks.is_installed() for hooks in _trainer_hooks())
    assert type(_load(tiny_paths[arch])) is STOCK[arch]
    assert type(AutoModelForCausalLM.from_config(config)) is STOCK[arch]


def test_enable_twice_and_disable_twice_are_harmless(tiny_paths):
    enable()
    enable()
    assert is_enabled()
    assert type(_load(tiny_paths["qwen2"])) is TRAINING_CLASSES["qwen2"]
    disable()
    assert not is_enabled()
    assert type(_load(tiny_paths["qwen2"])) is Qwen2ForCausalLM
    disable()
    assert not is_enabled()
    assert type(_load(tiny_paths["qwen2"])) is Qwen2ForCausalLM


def test_is_enabled_needs_every_part():
    enable()
    transformers_hooks.uninstall()
    assert not is_enabled()
    enable()
    for hooks in _trainer_hooks():
        hooks.uninstall()
        assert not is_enabled()
        hooks.install()
    assert is_enabled()


def test_context_manager(tiny_paths):
    with enabled():
        assert is_enabled()
        assert type(_load(tiny_paths["llama"])) is TRAINING_CLASSES["llama"]
        with enabled():  # nested: the inner exit leaves it on
            assert is_enabled()
        assert is_enabled()
    assert not is_enabled()
    assert type(_load(tiny_paths["llama"])) is LlamaForCausalLM


def test_context_manager_restores_off_when_body_raises(tiny_paths):
    with pytest.raises(RuntimeError, match="boom"), enabled():
        assert is_enabled()
        raise RuntimeError("boom")
    assert not is_enabled()
    assert type(_load(tiny_paths["qwen3"])) is Qwen3ForCausalLM


def test_context_manager_keeps_on_when_already_enabled(tiny_paths):
    enable()
    with pytest.raises(RuntimeError, match="boom"), enabled():
        raise RuntimeError("boom")
    assert is_enabled()
    assert type(_load(tiny_paths["qwen3"])) is TRAINING_CLASSES["qwen3"]
    with enabled():
        pass
    assert is_enabled()


def test_context_manager_restores_on_after_body_disables():
    enable()
    with enabled():
        disable()
    assert is_enabled()


def test_transformers_part_alone(tiny_paths):
    """`transformers_hooks.installed()`: the vexact classes registered, no trainer library touched."""
    with transformers_hooks.installed():
        assert transformers_hooks.is_installed()
        assert type(_load(tiny_paths["qwen2"])) is TRAINING_CLASSES["qwen2"]
        assert not any(hooks.is_installed() for hooks in _trainer_hooks())
        assert is_enabled() == (not _trainer_hooks())
    assert not transformers_hooks.is_installed()
    assert type(_load(tiny_paths["qwen2"])) is Qwen2ForCausalLM


def test_disable_leaves_foreign_registrations_alone(tiny_paths):
    """disable() removes only the vexact classes it registered."""

    class MyQwen3(Qwen3ForCausalLM):
        pass

    mapping = AutoModelForCausalLM._model_mapping._extra_content
    config_class = TRAINING_CLASSES["qwen3"].config_class
    previous = mapping.get(config_class, None)
    try:
        mapping[config_class] = MyQwen3  # as register() does (some transformers releases skip it)
        disable()
        assert type(_load(tiny_paths["qwen3"])) is MyQwen3
    finally:
        if previous is None:
            mapping.pop(config_class, None)
        else:
            mapping[config_class] = previous


def test_enable_module_is_the_switch():
    """Importing `vexact_vllm.model_patches.enable` (verl's external_lib) turns the switch on; it
    re-exports the switch, and, bound on the package in place of the function it shadows, is
    callable like it."""
    name = "vexact_vllm.model_patches.enable"
    module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    assert is_enabled()
    disable()
    assert module.enable is enable and module.disable is disable
    assert model_patches.enable is module  # the import machinery rebinds the package attribute
    model_patches.enable()
    assert is_enabled()


def test_package_exports():
    assert sorted(model_patches.__all__) == sorted(
        ["enable", "disable", "is_enabled", "enabled", "PackedBatch", "VexactForCausalLM", "DecoderConfig",
         "UnsupportedModelError", "SUPPORTED_ARCHITECTURES"]
    )  # fmt: skip
    for name in model_patches.__all__:
        assert getattr(model_patches, name) is not None


def test_vllm_config_copies_build_the_training_class(monkeypatch):
    """vLLM 0.26 registers its own copy of Qwen3-Next's config (same class name) with AutoConfig when it
    reads such a checkpoint; AutoModel must still build the training class from the copy, not fall back
    by name to transformers' Qwen3NextForCausalLM (which a colocated trainer would then run silently)."""
    import types

    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    import vexact_vllm
    from vexact_vllm.tiny_model import _make_config

    copy = type("Qwen3NextConfig", (Qwen3NextConfig,), {"__module__": "vllm_copy"})  # vLLM's copy
    vllm_config = types.ModuleType(transformers_hooks.VLLM_CONFIG_MODULE)
    vllm_config._CONFIG_REGISTRY = {"qwen3_next": copy}
    config = copy(**_make_config("qwen3_next", 64, 1).to_dict())
    with transformers_hooks.installed():
        assert type(AutoModelForCausalLM.from_config(config)) is Qwen3NextForCausalLM  # vLLM not loaded here
        monkeypatch.setitem(sys.modules, transformers_hooks.VLLM_CONFIG_MODULE, vllm_config)
        vexact_vllm._train_on_vllm_configs()  # what the vLLM plugin does once vLLM loads
        assert type(AutoModelForCausalLM.from_config(config)) is TRAINING_CLASSES["qwen3_next"]
    assert copy not in transformers_hooks._mapping()  # uninstalled with the rest
    with transformers_hooks.installed():  # installed again with vLLM loaded: the copy at once
        assert type(AutoModelForCausalLM.from_config(config)) is TRAINING_CLASSES["qwen3_next"]
