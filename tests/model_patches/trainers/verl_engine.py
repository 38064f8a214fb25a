"""verl 0.9.1's FSDP actor engine (`FSDPEngineWithLMHead`) on CPU, as deep as it runs, for the tests.

What runs unchanged: the engine's `__init__`, its `_build_module` (verl's `get_hf_auto_model_class`
-> `AutoModelForCausalLM.from_pretrained` with verl's config, `apply_monkey_patch`), and the whole
per-batch path `infer_batch` / `forward_backward_batch` -> `prepare_micro_batches` ->
`forward_step` (`prepare_model_inputs`, the model call under verl's autocast,
`prepare_model_outputs`) -> `postprocess_batch_func`, on verl's own no-padding TensorDict made by
`left_right_2_no_padding`, with the response log-probs cut out by `no_padding_2_padding`.

What cannot run on a CPU-only torch, and what stands in for it:
- verl's device layer falls back to its NVIDIA platform without a GPU: `get_device_name()` is
  "cuda" and `get_device_id()` calls `torch.cuda.current_device()` ("Torch not compiled with CUDA
  enabled"), first in `FSDPEngine.__init__` (device mesh) and `forward_step`
  (`micro_batch.to(get_device_id())`). Those two names are patched to "cpu" in the verl modules of
  this path, and `log_gpu_memory_usage` (`torch.cuda.mem_get_info`) is silenced.
- `initialize()` -> `_build_fsdp_module` -> `apply_fsdp2` -> torch's `fully_shard` pins the sharded
  parameters (`pin_memory()`: "Cannot access accelerator device when none is available"), so the
  FSDP2 wrap, the optimizer and the checkpoint manager do not run: the engine's `module` is the model
  `_build_module` returned (FSDP2 keeps the module's class, so the hooks see the same type).
- a process group: gloo, world size 1 (`forward_backward_batch` all-reduces the token count).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_DEVICE_MODULES = (
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.fsdp.utils",
    "verl.utils.fsdp_utils",
)


def cpu_verl(monkeypatch) -> None:
    """verl's device queries answer "cpu" on the engine's path (see the module docstring)."""
    import importlib

    for name in _DEVICE_MODULES:
        module = importlib.import_module(name)
        for attr in ("get_device_name", "get_device_id"):
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, lambda: "cpu")
        if hasattr(module, "device_name"):
            monkeypatch.setattr(module, "device_name", "cpu")
        if hasattr(module, "log_gpu_memory_usage"):
            monkeypatch.setattr(module, "log_gpu_memory_usage", lambda *args, **kwargs: None)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)


def build_engine(
    model_path: str, *, use_remove_padding: bool = True, forward_only: bool = True, override_config=None
):
    """verl's FSDPEngineWithLMHead for the checkpoint, its module built by verl (`_build_module`)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(
        path=model_path,
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=False,
        override_config=override_config or {},
    )
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", model_dtype="bf16", forward_only=forward_only, use_torch_compile=False
    )
    engine = FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=1e-6), CheckpointConfig())
    engine.module = engine._build_module()
    return engine


def rollout_batch(rollouts, temperature: float, pad_id: int, **flags):
    """verl's actor input for these rollouts: left-padded prompts + right-padded responses (the
    DataProto layout), converted by verl's `left_right_2_no_padding`, with verl's meta keys."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    n = len(rollouts)
    p_len = max(len(r.prompt_ids) for r in rollouts)
    r_len = max(len(r.output_ids) for r in rollouts)
    prompts = torch.full((n, p_len), pad_id, dtype=torch.long)
    responses = torch.full((n, r_len), pad_id, dtype=torch.long)
    mask = torch.zeros(n, p_len + r_len, dtype=torch.long)
    for i, r in enumerate(rollouts):
        prompts[i, p_len - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        responses[i, : len(r.output_ids)] = torch.tensor(r.output_ids)
        mask[i, p_len - len(r.prompt_ids) : p_len + len(r.output_ids)] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": mask,
            "position_ids": position_ids,
            "response_mask": mask[:, p_len:],
        },
        batch_size=n,
    )
    data = left_right_2_no_padding(data)
    meta = dict(
        temperature=temperature,
        calculate_entropy=True,
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        use_fused_kernels=False,
    )
    meta.update(flags)
    tu.assign_non_tensor(data, **meta)
    return data


def response_outputs(output, data) -> dict[str, torch.Tensor]:
    """verl's per-token model outputs (nested) -> [B, R] response tensors (`no_padding_2_padding`)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return {k: no_padding_2_padding(v, data) for k, v in output["model_output"].items()}
