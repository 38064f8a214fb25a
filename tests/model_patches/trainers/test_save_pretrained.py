"""A checkpoint saved by the vexact training class (what verl's trainer saves) names Hugging Face's
architecture, so stock transformers and vLLM load it, with the same weights (DeepSeek's router
correction bias included: written in fp32 from a bf16 model, as the published checkpoints hold it)."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from vexact_vllm.model_patches import VexactForCausalLM


@pytest.mark.parametrize(
    ("arch", "hf_name"),
    [("qwen3", "Qwen3ForCausalLM"), ("llama", "LlamaForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM"),
     ("deepseek_v2", "DeepseekV2ForCausalLM")],
)  # fmt: skip
def test_saved_config_names_the_hf_architecture(load_model, tmp_path, arch, hf_name):
    model = load_model(arch, torch.float32, vexact=True)
    assert isinstance(model, VexactForCausalLM)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [hf_name]
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # the switch is off here
    assert type(stock).__name__ == hf_name
    ours = dict(model.state_dict())
    assert stock.state_dict().keys() == ours.keys()
    for name, tensor in stock.state_dict().items():
        assert torch.equal(tensor, ours[name]), name


def test_deepseek_v3_bf16_save_keeps_the_correction_bias_fp32(load_model, tmp_path):
    model = load_model("deepseek_v3", torch.bfloat16, vexact=True)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    biases = {name for name in dtypes if name.endswith("mlp.gate.e_score_correction_bias")}
    assert len(biases) == 3  # the tiny V3: layer 0 dense, 1-3 sparse
    assert all(dtypes[name] == ("F32" if name in biases else "BF16") for name in dtypes), dtypes
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = dict(model.state_dict())
    for name, tensor in stock.state_dict().items():
        assert tensor.dtype == ours[name].dtype and torch.equal(tensor, ours[name]), name
