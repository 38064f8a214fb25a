"""`--model-impl vexact` resolution and the refusals that happen before any engine starts."""

from __future__ import annotations

import json

import pytest

from vexact_vllm import MODEL_IMPL
from vexact_vllm.model_patches.config import SUPPORTED_ARCHITECTURES
from vexact_vllm.registry import UnsupportedArchitectureError, vexact_architectures

pytestmark = pytest.mark.vllm


def _model_config(path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    import vexact_vllm

    vexact_vllm.register()
    return EngineArgs(model=str(path), **kwargs).create_model_config()


def test_mapping_and_unsupported_message():
    assert vexact_architectures(["Qwen3ForCausalLM"]) == ["VllmVexactQwen3ForCausalLM"]
    with pytest.raises(UnsupportedArchitectureError) as err:
        vexact_architectures(["GPT2LMHeadModel"])
    for name in ("GPT2LMHeadModel", *SUPPORTED_ARCHITECTURES):
        assert name in str(err.value)


def test_register_is_idempotent():
    from vllm.model_executor.models import ModelRegistry

    import vexact_vllm

    vexact_vllm.register()
    lookup = type(ModelRegistry).__dict__["resolve_model_cls"]
    vexact_vllm.register()
    assert type(ModelRegistry).__dict__["resolve_model_cls"] is lookup
    assert lookup._vexact
    assert "VllmVexactQwen3ForCausalLM" in ModelRegistry.models


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_vexact_resolves_and_other_impls_are_untouched(tiny_model, arch):
    path = tiny_model(arch)
    vexact = _model_config(path, model_impl=MODEL_IMPL)
    assert vexact._architecture.startswith("VllmVexact")
    assert not vexact.logits_processors  # runner v2 (vLLM 0.26) would refuse any
    for impl in ("auto", "vllm"):
        stock = _model_config(path, model_impl=impl)
        assert not stock._architecture.startswith("VllmVexact")
        assert not stock.logits_processors


def test_unsupported_architecture_fails_at_startup(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(Exception, match="does not support architecture GPT2"):
        _model_config(tmp_path, model_impl=MODEL_IMPL)


def test_float16_is_refused(tiny_model):
    with pytest.raises(Exception, match="use bfloat16 or float32"):
        _model_config(tiny_model("qwen3"), model_impl=MODEL_IMPL, dtype="float16")


def test_quantized_checkpoint_is_refused(tiny_model, tmp_path):
    import shutil

    src = tiny_model("qwen3")
    shutil.copytree(src, tmp_path / "q")
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for method, message in (("fp8", "convert the checkpoint to bf16"), ("awq", "quantized checkpoints are not supported")):
        cfg["quantization_config"] = {"quant_method": method, "activation_scheme": "dynamic"}
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(Exception, match=message):
            _model_config(tmp_path / "q", model_impl=MODEL_IMPL)
