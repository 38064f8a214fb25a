"""The vLLM model class loads Hugging Face-named tensors: whole checkpoints, partial buckets (as RL
frameworks sync weights), and refuses malformed ones with a message naming the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vexact_vllm import MODEL_IMPL

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def build_vllm_model():
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    import vexact_vllm
    from vexact_vllm.vllm_wrapper import VllmVexactForCausalLM

    vexact_vllm.register()

    def build(path: str) -> VllmVexactForCausalLM:
        cfg = EngineArgs(model=path, model_impl=MODEL_IMPL, block_size=32).create_engine_config()
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with set_current_vllm_config(cfg):
                return VllmVexactForCausalLM(vllm_config=cfg)
        finally:
            torch.set_default_dtype(old)

    return build


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_full_load_matches_the_training_class(build_vllm_model, tiny_model, arch):
    from vexact_vllm.cli.score import load_trainer

    path = tiny_model(arch)
    model = build_vllm_model(path)
    loaded = model.load_weights(_checkpoint(path).items())
    assert loaded == {name for name, _ in model.named_parameters()}
    trainer = load_trainer(path, torch.bfloat16, torch.device("cpu"))
    train_params = dict(trainer.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, train_params[name]), name
    assert torch.equal(model.lm_head_weight, trainer.lm_head.weight)


def test_partial_buckets_update_only_their_tensors(build_vllm_model, tiny_model):
    path = tiny_model("qwen3")
    model = build_vllm_model(path)
    tensors = _checkpoint(path)
    model.load_weights(tensors.items())
    names = sorted(tensors)
    bucket = {n: tensors[n] + 1 for n in names[:3]}  # perturbed, as after an optimizer step
    assert model.load_weights(bucket.items()) == set(bucket)
    params = dict(model.named_parameters())
    for n in names:
        expected = bucket.get(n, tensors[n])
        assert torch.equal(params[n], expected), n


def test_malformed_tensors_are_refused(build_vllm_model, tiny_model):
    from vexact_vllm.model_patches.config import UnsupportedModelError

    model = build_vllm_model(tiny_model("qwen3"))
    name = "model.layers.0.self_attn.q_proj.weight"
    good = _checkpoint(tiny_model("qwen3"))[name]
    with pytest.raises(UnsupportedModelError, match="does not belong"):
        model.load_weights([("model.layers.0.self_attn.qkv_proj.weight", good)])
    with pytest.raises(UnsupportedModelError, match=r"has shape \(3, 3\)"):
        model.load_weights([(name, torch.zeros(3, 3))])
    with pytest.raises(UnsupportedModelError, match="not floating point"):
        model.load_weights([(name, torch.zeros_like(good, dtype=torch.int8))])
    # ignored: rotary buffers, and lm_head when the embeddings are tied
    assert model.load_weights([("model.rotary_emb.inv_freq", torch.zeros(4))]) == set()
