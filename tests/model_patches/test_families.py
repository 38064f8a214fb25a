"""The family table derives every per-family class and built-in model; the vLLM and training
classes of a family have different names."""

from __future__ import annotations

import pickle

import pytest

from vexact_vllm.model_patches.families import FAMILIES


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model_type)
def test_every_row_derives_every_class(family):
    from vexact_vllm.model_patches.config import SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES
    from vexact_vllm.model_patches.trainers import hf_causal_lm
    from vexact_vllm.model_shapes import BUILTIN_MODELS

    assert SUPPORTED_MODEL_TYPES[family.model_type] == family.architecture
    assert family.architecture in SUPPORTED_ARCHITECTURES
    training = hf_causal_lm.TRAINING_CLASSES[family.model_type]
    assert training.__name__ == family.training_name == f"Vexact{family.architecture}"
    assert getattr(hf_causal_lm, family.training_name) is training
    assert pickle.loads(pickle.dumps(training)) is training  # found by name, as FSDP/Ray pickling needs
    assert training.config_class.model_type == family.model_type
    assert training.hf_architecture == family.architecture
    assert family.vllm_name != family.training_name and family.vllm_name.startswith("VllmVexact")
    assert family.tiny_name in BUILTIN_MODELS if family.tiny is not None else family.tiny_name is None
    assert family.decoder_class().__module__.endswith(f"models.{family.module}")


def test_vllm_registry_names_one_per_family():
    from vexact_vllm.registry import VEXACT_ARCHITECTURES

    assert VEXACT_ARCHITECTURES == {f.architecture: f.vllm_name for f in FAMILIES}


def test_veomni_classes_follow_the_table():
    pytest.importorskip("veomni")
    from vexact_vllm.model_patches.trainers import veomni_classes

    for family in FAMILIES:
        cls = veomni_classes.VEOMNI_CLASSES[family.model_type]
        assert cls.__name__ == f"VeOmni{family.training_name}"
        assert getattr(veomni_classes, cls.__name__) is cls
