"""A checkpoint saved by the vexact training class (what verl's trainer saves) names Hugging Face's
architecture, so stock transformers and vLLM load it, with the same weights."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from vexact_vllm.model_patches import VexactForCausalLM


@pytest.mark.parametrize(("arch", "hf_name"), [("qwen3", "Qwen3ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_saved_config_names_the_hf_architecture(load_model, tmp_path, arch, hf_name):
    model = load_model(arch, torch.float32, vexact=True)
    assert isinstance(model, VexactForCausalLM)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [hf_name]
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # the switch is off here
    assert type(stock).__name__ == hf_name
    ours = dict(model.state_dict())
    for name, tensor in stock.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
