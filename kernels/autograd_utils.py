"""The shared kernels' autograd Functions run their backward as their forward ran: with autocast off.

The forwards fix their own dtypes (the model turns autocast off around them). A backward, though,
runs under whatever autocast the caller's thread has on when it calls `.backward()`, and a backward
that multiplies in fp32 on purpose would then be recast to bf16: gradients would depend on where
the caller put its `with torch.autocast(...)`. `backward_without_autocast` turns it off for the
gradients' device, as `torch.amp.custom_bwd` does for a forward that ran without autocast.
"""

from __future__ import annotations

import functools

import torch


def backward_without_autocast(backward):
    """Decorate an autograd Function's `backward(ctx, *grads)` (under its @staticmethod)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        ref = next((g for g in grads if isinstance(g, torch.Tensor)), None)
        if ref is None or not torch.is_autocast_enabled(ref.device.type):
            return backward(ctx, *grads)
        with torch.autocast(device_type=ref.device.type, enabled=False):
            return backward(ctx, *grads)

    return wrapper
