"""The shared model wrapped by FSDP2 the way VeOmni (and verl's `strategy=fsdp2`) wrap it: each
DecoderLayer (`_no_split_modules`) and the root under `fully_shard`, fp32 masters, MixedPrecisionPolicy
with bf16 parameters and `cast_forward_inputs=True`. That policy casts every floating-point tensor
argument of a wrapped layer to bf16, so the layers must not take the fp32 RoPE table as an argument
(it would arrive as bf16: "cache has dtype torch.bfloat16"). Here the log-probs and
the gradients must be the bf16 model's, bit for bit. A gloo group of one rank on the CPU: the casts and
the hooks are FSDP2's own; only the collectives are trivial. DeepSeek-V3's router keeps its
`e_score_correction_bias` in fp32 (a buffer: the policy casts parameters only), so the experts it
chooses are the bf16 model's."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.model_patches.trainers.test_autocast import ppo_forward
from tests.model_patches.trainers.test_hf_causal_lm import random_ids


@pytest.fixture(scope="module")
def mesh():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    return init_device_mesh("cpu", (1,))


def _shard(model, mesh):
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    layers = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
    assert layers  # the test can fail: the policy must reach the layers
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_fsdp2_bf16_policy_over_fp32_masters_equals_the_bf16_model(load_model, mesh, arch):
    bf16 = load_model(arch, torch.bfloat16, True)
    sharded = _shard(load_model(arch, torch.float32, True).train(), mesh)
    bf16.train()
    ids = random_ids((2, 11), seed=3)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # a right-padded row
    want = ppo_forward(bf16, ids, mask)
    got = ppo_forward(sharded, ids, mask)
    assert got.log_probs.dtype == torch.float32
    assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy)
    biases = {n: b for n, b in sharded.named_buffers() if n.endswith("e_score_correction_bias")}
    assert len(biases) == (3 if arch == "deepseek_v3" else 0)  # the tiny V3: layers 1-3 sparse
    bf16_buffers = dict(bf16.named_buffers())
    for name, bias in biases.items():
        assert bias.dtype == torch.float32 and bias.abs().min() > 0, name
        assert torch.equal(bias, bf16_buffers[name]), name

    want.log_probs.sum().backward()
    got.log_probs.sum().backward()
    bf16_params = dict(bf16.named_parameters())
    for name, p in sharded.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert grad.dtype == torch.float32, name
        assert torch.equal(grad, bf16_params[name].grad.float()), name
