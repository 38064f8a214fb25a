"""Helpers shared by the VeOmni engine tests, in one rank (test_veomni_engine.py) and in the two
ranks that test_veomni_fsdp.py spawns (veomni_fsdp_rank.py imports this file by path, so it has no
relative imports): verl's CPU platform, the engine's compute-log-prob input, the comparison with
vLLM's log-probs, and VeOmni's process-wide state restored."""

from __future__ import annotations

import contextlib
import socket

import torch
from verl.plugin.platform.platform_base import PlatformBase


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlatformCPU(PlatformBase):
    """The CPU as a verl platform (verl ships CUDA, NPU and ROCm ones)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


@contextlib.contextmanager
def veomni_process_state():
    """Restore what VeOmni's apply_ops_config changes process-wide (transformers' LOSS_MAPPING, whose
    VeOmni wrappers return 3-tuples that stock HF forwards cannot use, and its ops-config singleton)."""
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.ops.config import singleton

    mapping, ops = dict(LOSS_MAPPING), singleton.get_ops_config()
    try:
        yield
    finally:
        LOSS_MAPPING.clear()
        LOSS_MAPPING.update(mapping)
        singleton.set_ops_config(ops)


def actor_batch(rollouts, temperature: float, micro_batch_size: int):
    """The actor's compute-log-prob input as verl's trainer hands it to the engine (no padding)."""
    from verl.utils import tensordict_utils as tu

    seqs = [torch.tensor(r.prompt_ids + r.output_ids) for r in rollouts]
    masks = [torch.tensor([0] * len(r.prompt_ids) + [1] * len(r.output_ids)) for r in rollouts]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)
    return tu.get_tensordict(
        {
            "input_ids": nested(seqs),
            "position_ids": nested([torch.arange(len(s)) for s in seqs]),
            "loss_mask": nested(masks),
        },
        {
            "temperature": temperature,
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": micro_batch_size,
            "use_remove_padding": True,
            "use_fused_kernels": True,
            "calculate_entropy": True,
        },
    )


def _generated_log_probs(log_probs, rollouts):
    """Row t of a sequence scores token t+1; keep the rows that score the generated tokens."""
    out = []
    for lp, r in zip(log_probs.unbind(), rollouts):
        first = len(r.prompt_ids) - 1
        out.append(lp[first : first + len(r.output_ids)])
    return out


def assert_engine_equals_vllm(engine, masked_rollouts, micro_batch_size):
    """The engine's log-probs of every generated token are torch.equal to vLLM's, at each temperature."""
    for temperature, rollouts in masked_rollouts.items():
        data = actor_batch(rollouts, temperature, micro_batch_size)
        with engine.eval_mode():
            out = engine.forward_backward_batch(data, loss_function=None, forward_only=True)
        scored = _generated_log_probs(out["model_output"]["log_probs"], rollouts)
        for r, s in zip(rollouts, scored):
            assert torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), s), (
                temperature,
                micro_batch_size,
            )
        entropy = out["model_output"]["entropy"]
        assert bool(torch.isfinite(entropy.values()).all()) and bool((entropy.values() >= 0).all())
