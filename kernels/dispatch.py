"""The one place that picks a backend for each kernel call.

Every public op looks up its implementation with `backend_for(tensor)` in a small per-op table
(`{"torch": _op_torch}` today). The torch path is the batch-invariant reference and runs anywhere;
the Triton path serves CUDA tensors, chosen here and only here.

`reference_mode()` forces the torch reference for every call (tests compare the two backends with
it). The switch is a small symmetric API: `enable_reference_mode`, `disable_reference_mode`,
`is_reference_mode_enabled`, and the `reference_mode()` context manager, which restores the
previous state in `finally`.
"""

import contextlib
from collections.abc import Iterator

import torch

from .settings import get_settings

_reference_mode = False
# Backend of CUDA tensors outside reference mode.
_CUDA_BACKEND = "triton"


def enable_reference_mode() -> None:
    """Run every kernel on the torch reference path until `disable_reference_mode()`."""
    global _reference_mode
    _reference_mode = True


def disable_reference_mode() -> None:
    """Let `backend_for` choose the backend again."""
    global _reference_mode
    _reference_mode = False


def is_reference_mode_enabled() -> bool:
    return _reference_mode


@contextlib.contextmanager
def reference_mode(enabled: bool = True) -> Iterator[None]:
    """Scope in which reference mode is `enabled`; the previous state comes back on exit."""
    global _reference_mode
    previous = _reference_mode
    _reference_mode = enabled
    try:
        yield
    finally:
        _reference_mode = previous


def backend_for(tensor: torch.Tensor) -> str:
    """ "torch" or "triton" for a call whose main input is `tensor`.

    CUDA tensors take the Triton kernels; CPU tensors (and everything in reference mode) the torch
    path. The two backends agree only to rounding: the rollout and the trainer must use the same one.
    """
    if _reference_mode or tensor.device.type != "cuda":
        return "torch"
    return _CUDA_BACKEND


def cuda_attention_backend() -> str:
    """The CUDA attention kernels both sides run: "triton" or "fa4" (`settings.get_settings()`,
    VEXACT_ATTENTION)."""
    return get_settings().attention


def attention_backend_for(tensor: torch.Tensor) -> str:
    """ "torch", "triton" or "fa4" for an attention call whose main input is `tensor`: `backend_for`'s
    choice, with the settings' attention backend picking among the CUDA attention kernels."""
    backend = backend_for(tensor)
    return backend if backend == "torch" else cuda_attention_backend()


def key_split() -> int:
    """Keys per split of the Triton attention's reduction (`settings.get_settings()`,
    VEXACT_KEY_SPLIT); 0: no split.

    A positive value C (a multiple of 64, the key tile) reduces each query's keys in chunks of C
    anchored at key 0, folded in order (kernels/attention/core_triton.py, "Key splits"). It changes the
    bits of every query past position C on the CUDA Triton path, the trainer's and the rollout's
    alike, so both must read the same value; the torch (CPU) path and FA4 take no split."""
    return get_settings().key_split
