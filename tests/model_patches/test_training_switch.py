"""enable_training / disable_training / is_training_enabled / training_enabled: AutoModelForCausalLM
builds the vexact classes only while the switch is on, and the switch is symmetric and reversible."""

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from vexact_vllm.model_patches import (
    VexactForCausalLM,
    disable_training,
    enable_training,
    is_training_enabled,
    training_enabled,
)
from vexact_vllm.model_patches.hf_model import TRAINING_CLASSES

STOCK = {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}
ARCHS = list(STOCK)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("arch", ARCHS)
def test_enable_then_disable(tiny_paths, arch):
    assert not is_training_enabled()
    assert type(_load(tiny_paths[arch])) is STOCK[arch]
    enable_training()
    assert is_training_enabled()
    model = _load(tiny_paths[arch])
    assert type(model) is TRAINING_CLASSES[arch] and isinstance(model, VexactForCausalLM)
    assert model.dtype == torch.float32
    config = AutoConfig.from_pretrained(tiny_paths[arch])
    assert type(AutoModelForCausalLM.from_config(config)) is TRAINING_CLASSES[arch]
    disable_training()
    assert not is_training_enabled()
    assert type(_load(tiny_paths[arch])) is STOCK[arch]
    assert type(AutoModelForCausalLM.from_config(config)) is STOCK[arch]


def test_enable_twice_and_disable_twice_are_harmless(tiny_paths):
    enable_training()
    enable_training()
    assert is_training_enabled()
    assert type(_load(tiny_paths["qwen2"])) is TRAINING_CLASSES["qwen2"]
    disable_training()
    assert not is_training_enabled()
    assert type(_load(tiny_paths["qwen2"])) is Qwen2ForCausalLM
    disable_training()
    assert not is_training_enabled()
    assert type(_load(tiny_paths["qwen2"])) is Qwen2ForCausalLM


def test_context_manager(tiny_paths):
    with training_enabled():
        assert is_training_enabled()
        assert type(_load(tiny_paths["llama"])) is TRAINING_CLASSES["llama"]
        with training_enabled():  # nested: the inner exit leaves it on
            assert is_training_enabled()
        assert is_training_enabled()
    assert not is_training_enabled()
    assert type(_load(tiny_paths["llama"])) is LlamaForCausalLM


def test_context_manager_restores_off_when_body_raises(tiny_paths):
    with pytest.raises(RuntimeError, match="boom"), training_enabled():
        assert is_training_enabled()
        raise RuntimeError("boom")
    assert not is_training_enabled()
    assert type(_load(tiny_paths["qwen3"])) is Qwen3ForCausalLM


def test_context_manager_keeps_on_when_already_enabled(tiny_paths):
    enable_training()
    with pytest.raises(RuntimeError, match="boom"), training_enabled():
        raise RuntimeError("boom")
    assert is_training_enabled()
    assert type(_load(tiny_paths["qwen3"])) is TRAINING_CLASSES["qwen3"]
    with training_enabled():
        pass
    assert is_training_enabled()


def test_context_manager_restores_on_after_body_disables():
    enable_training()
    with training_enabled():
        disable_training()
    assert is_training_enabled()


def test_disable_leaves_foreign_registrations_alone(tiny_paths):
    """disable_training removes only the vexact classes it registered."""

    class MyQwen3(Qwen3ForCausalLM):
        pass

    mapping = AutoModelForCausalLM._model_mapping._extra_content
    config_class = TRAINING_CLASSES["qwen3"].config_class
    previous = mapping.get(config_class, None)
    try:
        mapping[config_class] = MyQwen3  # as register() does (some transformers releases skip it)
        disable_training()
        assert type(_load(tiny_paths["qwen3"])) is MyQwen3
    finally:
        if previous is None:
            mapping.pop(config_class, None)
        else:
            mapping[config_class] = previous
