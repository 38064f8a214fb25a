"""What the shared model does under a trainer's autocast: compute in the autocast dtype, like torch's own
layers, with the fp32 master weights rounded to it once per forward.

Trainers keep fp32 master weights and compute in bf16 one of two ways. FSDP2's mixed-precision
policy hands the forward bf16 parameters (verl's FSDP engine; VeOmni on more than one rank): nothing
to do here. Or the parameters stay fp32 and an autocast context asks for bf16 (VeOmni on one rank,
plain single-GPU training): torch's Linear then multiplies bf16 casts of its fp32 weights. The
shared kernels fix their own dtypes and run with autocast off, so without this they would compute
in fp32 there, while the rollout computes in bf16: every log-prob would differ.

`follows_autocast` wraps a model's forward: when autocast is on for the inputs' device, asks for a
dtype below the parameters' fp32, the forward runs through `torch.func.functional_call` on the
parameters cast to that dtype (round to nearest, the cast FSDP's policy and vLLM's weight loading
apply). Gradients flow back through the cast to the fp32 parameters. An autocast dtype the shared
kernels do not support (float16) is refused with the usual dtype error.
"""

from __future__ import annotations

import functools

import torch

from .config import check_dtype


def autocast_dtype(module: torch.nn.Module, device_type: str) -> torch.dtype | None:
    """The dtype to cast `module`'s fp32 parameters to for a forward on `device_type`, or None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    param = next(module.parameters(), None)
    if param is None or param.dtype != torch.float32 or dtype == torch.float32:
        return None
    return check_dtype(dtype)


def follows_autocast(forward):
    """Decorate a model's `forward(self, input_ids, ...)` (see the module docstring)."""

    @functools.wraps(forward)
    def wrapper(self, input_ids=None, *args, **kwargs):
        dtype = None if input_ids is None else autocast_dtype(self, input_ids.device.type)
        if dtype is None:
            return forward(self, input_ids, *args, **kwargs)
        params = {name: p.to(dtype) for name, p in self.named_parameters()}
        # Re-enters this wrapper with the cast parameters in place: then dtype is None and it runs.
        return torch.func.functional_call(self, params, (input_ids, *args), kwargs)

    return wrapper
