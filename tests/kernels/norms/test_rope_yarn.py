"""YaRN rotary tables (`kernels/norms/rope.py`): transformers' frequencies and attention factor (DeepSeek-V2's
and V3's configs, a Qwen-style one), rounded once from float64; a row the same for any table length."""

import math

import pytest
import torch

from vexact_vllm.kernels import rope_cache
from vexact_vllm.kernels.norms.rope import attention_factor

YARNS = [
    # DeepSeek-V3 / Kimi-K2: mscale = mscale_all_dim = 1 (factor 1 on cos/sin)
    dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
         beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    # DeepSeek-V2-Lite: mscale = mscale_all_dim = 0.707
    dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
         beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    # Qwen-style: no mscale fields (factor 0.1 ln(4) + 1 on cos/sin)
    dict(rope_type="yarn", rope_theta=1_000_000.0, factor=4.0, original_max_position_embeddings=32768),
]  # fmt: skip


@pytest.mark.parametrize("rope", YARNS)
@pytest.mark.parametrize("dim", [64, 16])
def test_yarn_matches_transformers(rope, dim):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DeepseekV3Config(qk_rope_head_dim=dim, rope_parameters=dict(rope), max_position_embeddings=163840)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert math.isclose(attention_factor(rope), factor, rel_tol=1e-12)
    table = rope_cache(dim, 2048, rope["rope_theta"], rope)
    positions = torch.arange(2048, dtype=torch.float64)[:, None]
    want = torch.cat([torch.cos(positions * inv_freq.double()), torch.sin(positions * inv_freq.double())], -1)
    torch.testing.assert_close(table.double(), want * factor, rtol=0, atol=5e-4)  # fp32 frequencies there
    assert torch.equal(rope_cache(dim, 64, rope["rope_theta"], rope), table[:64])


def test_yarn_without_a_factor_takes_the_context_ratio():
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=None, original_max_position_embeddings=4096)
    assert math.isclose(attention_factor(rope, 16384), 0.1 * math.log(4.0) + 1.0)
    assert torch.equal(rope_cache(64, 32, 1e4, rope, model_max_positions=16384),
                       rope_cache(64, 32, 1e4, {**rope, "factor": 4.0}))  # fmt: skip


def test_other_rope_types_have_no_attention_factor():
    assert attention_factor(None) == attention_factor({"rope_type": "linear", "factor": 2.0}) == 1.0
