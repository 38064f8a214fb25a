"""What the shared model does under a trainer's autocast: compute in the autocast dtype, like torch's own
layers, with the fp32 master weights rounded to it once per call.

Trainers keep fp32 master weights and compute in bf16 one of two ways. FSDP2's mixed-precision
policy hands the forward bf16 parameters (verl's FSDP engine; VeOmni on more than one rank): nothing
to do here. Or the parameters stay fp32 and an autocast context asks for bf16 (VeOmni on one rank,
plain single-GPU training): torch's Linear then multiplies bf16 casts of its fp32 weights. The
shared kernels fix their own dtypes and run with autocast off, so without this they would compute
in fp32 there, while the rollout computes in bf16: every log-prob would differ.

`follows_autocast` wraps a model's entry points (`forward`, `packed_log_probs`): when autocast is on
for the parameters' device, the method runs with autocast off and, if autocast asks for a dtype
below the parameters' fp32, inside `cast_parameters`: every parameter replaced by its cast to that
dtype (round to nearest, the cast FSDP's policy and vLLM's weight loading apply), the masters put
back on the way out. Gradients flow back through the cast to the fp32 parameters. An autocast dtype
the shared kernels do not support (float16) is refused with the usual dtype error.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..config import check_dtype


def autocast_dtype(module: torch.nn.Module, device_type: str) -> torch.dtype | None:
    """The dtype to cast `module`'s fp32 parameters to for a call on `device_type`, or None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    param = next(module.parameters(), None)
    if param is None or param.dtype != torch.float32 or dtype == torch.float32:
        return None
    return check_dtype(dtype)


@contextlib.contextmanager
def cast_parameters(module: torch.nn.Module, dtype: torch.dtype):
    """Within the block, every parameter of `module` (submodules included) is its cast to `dtype`.

    One cast per parameter tensor, so tied weights stay tied; the casts are differentiable, so a
    backward reaches the original parameters. The originals are put back in `finally`.
    """
    casts: dict[int, torch.Tensor] = {}
    slots = []  # (submodule, name, original parameter)
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                if id(param) not in casts:
                    casts[id(param)] = param.to(dtype)
                slots.append((sub, name, param))
    try:
        for sub, name, param in slots:
            sub._parameters[name] = casts[id(param)]  # what torch.func.functional_call swaps in, too
        yield
    finally:
        for sub, name, param in slots:
            sub._parameters[name] = param


def follows_autocast(method):
    """Decorate a model method that runs the shared model (see the module docstring)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        param = next(self.parameters(), None)
        device_type = None if param is None else param.device.type  # where the model computes
        if not (device_type and torch.amp.is_autocast_available(device_type)
                and torch.is_autocast_enabled(device_type)):
            return method(self, *args, **kwargs)
        dtype = autocast_dtype(self, device_type)
        if dtype is not None and self.training and any(getattr(m, "gradient_checkpointing", False) for m in self.modules()):
            raise ValueError(
                "gradient checkpointing with fp32 parameters under a bf16 autocast is not supported by vexact "
                "models (the recomputation would see the fp32 parameters, not their casts): keep the "
                "parameters in bf16 (FSDP's mixed-precision policy) or turn gradient checkpointing off"
            )
        cast = contextlib.nullcontext() if dtype is None else cast_parameters(self, dtype)
        with torch.autocast(device_type=device_type, enabled=False), cast:
            return method(self, *args, **kwargs)

    return wrapper
