"""Tensor parallelism on Moonlight-16B-A3B-shaped layers (MLA 128 + 64 / 128 over a 512 latent, 16 heads;
a dense layer, then 64 experts of 1408 top-6 with 2 shared, sigmoid routing with the fp32 correction bias):
T ranks (threads, tests/model_patches/test_tensor_parallel.py's ThreadGroup) each cut their shard from the
whole model's tensors as vLLM's `load_weights` does (heads for q_proj and kv_b_proj, the latent path
replicated, experts by columns) and run it on the GPU; every rank's hidden states equal the unsharded
decoder's (the trainer's), bit for bit. The CPU runs the same at a reduced width (random shapes of every
family are in test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config

from tests.model_patches.test_tensor_parallel import ThreadGroup, rank_decoder
from vexact_vllm.model_patches.attention_context import PackedAttention
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.models import build_decoder
from vexact_vllm.model_shapes import MOONLIGHT_16B_A3B_SHAPE


def moonlight_layers(**narrower) -> DecoderConfig:
    """Moonlight's first two layers (dense, sparse); `narrower` overrides fields (the CPU's width)."""
    fields = {**MOONLIGHT_16B_A3B_SHAPE, "num_hidden_layers": 2, **narrower}
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    return DecoderConfig.from_hf(DeepseekV3Config(**fields, rope_parameters=rope))


def _check(config: DecoderConfig, tp: int, lens: list[int], device: str) -> None:
    torch.manual_seed(tp)
    with torch.device(device):
        whole = build_decoder(config)
        with torch.no_grad():
            for p in whole.parameters():
                p.copy_(torch.randn(p.shape) * 0.02)
            for name, b in whole.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape) * 0.01)
        whole = whole.to(torch.bfloat16).eval()
        ids = torch.randint(0, config.vocab_size, (sum(lens),))
        positions = torch.cat([torch.arange(n) for n in lens])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    biases = [b for n, b in whole.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(biases) == 1 and biases[0].dtype == torch.float32  # layer 1 routes with it, in fp32
    with torch.no_grad():
        want = whole(ids, positions, PackedAttention(cu))
    state = {k: v.detach() for k, v in whole.state_dict().items()}

    def rank(r_tp):
        with torch.device(device):
            model = rank_decoder(config, r_tp, state)
        with torch.no_grad():
            return model(ids, positions, PackedAttention(cu))

    group = ThreadGroup(tp)
    for r, out in enumerate(group.run(rank)):
        assert torch.equal(out, want), (tp, r)
    assert want.abs().max() > 0 and group.calls == 4 * 2 + 2  # per layer 4 gathers; the shared experts' 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cuda_ranks_reproduce_the_unsharded_moonlight_layers(tp):
    _check(moonlight_layers(), tp, [300, 1, 57], "cuda")


def test_cpu_ranks_reproduce_the_unsharded_moonlight_layers():
    """Moonlight's head sizes, latent and routing; 8 experts of 64 and a 256-wide residual, T = 4."""
    config = moonlight_layers(hidden_size=256, intermediate_size=384, moe_intermediate_size=64, n_routed_experts=8,
                              vocab_size=300)  # fmt: skip
    assert (config.head_dim, config.mla.v_head_dim, config.mla.kv_lora_rank, config.num_heads) == (
        192,
        128,
        512,
        16,
    )
    _check(config, 4, [40, 1, 9], "cpu")
