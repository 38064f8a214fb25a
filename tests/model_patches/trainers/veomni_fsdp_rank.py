"""verl's VeOmni actor engine with FSDP on, over a gloo group of two CPU processes, for
test_veomni_fsdp.py: `python tests/model_patches/trainers/veomni_fsdp_rank.py CASE.pkl PORT` spawns two ranks; each
builds the engine as verl's worker does
(`VeOmniEngineWithLMHead(...)._build_model_optimizer()`: VeOmni's `build_foundation_model` on the
meta device, `build_parallelize_model` -> FSDP2 over both ranks with VeOmni's mixed precision, bf16
over fp32 masters, `cast_forward_inputs`, weights loaded by rank 0 and broadcast, the optimizer),
then scores the rollouts in `case` and checks them against vLLM's log-probs; then one training
step's backward. Raises on any difference (mp.spawn re-raises it in the test)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import torch


def run(rank: int, world: int, port: int, case: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _score(case)
    finally:
        dist.destroy_process_group()


def _score(case: dict) -> None:
    from torch.distributed.fsdp import FSDPModule
    from veomni_cpu import PlatformCPU, actor_batch, assert_engine_equals_vllm, veomni_process_state
    from verl.plugin.platform import platform_manager
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, VeOmniEngineConfig, VeOmniOptimizerConfig
    from verl.workers.engine.veomni import transformer_impl

    from vexact_vllm.model_patches import enabled

    platform_manager.set_platform(PlatformCPU())
    with veomni_process_state(), enabled():
        engine = transformer_impl.VeOmniEngineWithLMHead(
            model_config=HFModelConfig(path=case["model"], enable_gradient_checkpointing=False),
            # verl's yaml defaults (veomni.yaml: init_device meta, mixed_precision true; the dataclass
            # defaults mixed precision off); no torch.compile on CPU.
            engine_config=VeOmniEngineConfig(init_device="meta", mixed_precision=True, use_torch_compile=False),
            optimizer_config=VeOmniOptimizerConfig(lr=1e-6, total_training_steps=1),
            checkpoint_config=CheckpointConfig(),
        )
        engine._build_model_optimizer()
        model = engine.module
        layers = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert len(layers) > 1, "VeOmni did not shard the layers"
        assert all(p.dtype == torch.float32 for p in model.parameters()), "expected fp32 masters"
        _check_correction_bias(model, case["model"])
        assert_engine_equals_vllm(engine, case["rollouts"], micro_batch_size=2)

        def loss_function(model_output, data, dp_group):
            mask = data["loss_mask"].values().to(torch.float32)
            return -(model_output["log_probs"].values() * torch.roll(mask, -1)).sum(), {}

        with engine.train_mode(zero_grad_on_exit=False):
            engine.forward_backward_batch(actor_batch(case["rollouts"][0.7], 0.7, 2), loss_function=loss_function)
        for name, p in model.named_parameters():
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            assert grad is not None and bool(torch.isfinite(grad).all()), name


def _check_correction_bias(model, path: str) -> None:
    """DeepSeek-V3's router bias, a buffer (not sharded, not cast): fp32 and the checkpoint's values on
    every rank after VeOmni's meta-device build and rank 0's broadcast."""
    from safetensors.torch import load_file

    biases = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    if not biases:
        return
    saved = load_file(str(Path(path) / "model.safetensors"))
    for name, bias in biases.items():
        want = saved[name]
        assert bias.dtype == torch.float32 and want.abs().min() > 0, name
        assert torch.equal(bias.cpu(), want), name


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # veomni_cpu, in the ranks too
    with open(sys.argv[1], "rb") as f:
        case = pickle.load(f)
    mp.spawn(run, args=(2, int(sys.argv[2]), case), nprocs=2, join=True)
