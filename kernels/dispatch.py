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
import os
from collections.abc import Iterator

import torch

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


# VEXACT_ATTENTION: the attention kernels of CUDA tensors, on both sides ("triton", or "fa4":
# FlashAttention-4 on Hopper, kernels/attention_fa4.py). The trainer and the rollout must agree.
ATTENTION_BACKENDS = ("triton", "fa4")


def cuda_attention_backend() -> str:
    """VEXACT_ATTENTION's choice among the CUDA attention kernels ("triton" when unset); ValueError
    for anything else."""
    chosen = os.environ.get("VEXACT_ATTENTION", "") or "triton"
    if chosen not in ATTENTION_BACKENDS:
        raise ValueError(
            f"VEXACT_ATTENTION must be one of {', '.join(ATTENTION_BACKENDS)} (the attention kernels, the same "
            f"on the trainer and the rollout), got {chosen!r}"
        )
    return chosen


def attention_backend_for(tensor: torch.Tensor) -> str:
    """ "torch", "triton" or "fa4" for an attention call whose main input is `tensor`: `backend_for`'s
    choice, with VEXACT_ATTENTION picking among the CUDA attention kernels (read at each call)."""
    backend = backend_for(tensor)
    return backend if backend == "torch" else cuda_attention_backend()


# Keys per split of the Triton attention when VEXACT_KEY_SPLIT is unset (session 28 made it the
# default: docs/BENCHMARKS.md, "Session 28").
DEFAULT_KEY_SPLIT = 2048


def key_split() -> int:
    """VEXACT_KEY_SPLIT: keys per split of the Triton attention's reduction; 0 turns the split off;
    unset, DEFAULT_KEY_SPLIT (0 under VEXACT_ATTENTION=fa4, which takes no split).

    A positive value C (a multiple of 64, the key tile) reduces each query's keys in chunks of C
    anchored at key 0, folded in order (kernels/attention_triton.py, "Key splits"). It changes the
    bits of every query past position C on the CUDA Triton path, the trainer's and the rollout's
    alike, so both must read the same value: the same setting, or both unset; the torch (CPU) path
    and FA4 take no split."""
    text = os.environ.get("VEXACT_KEY_SPLIT", "")
    if not text:
        return 0 if cuda_attention_backend() == "fa4" else DEFAULT_KEY_SPLIT
    try:
        keys = int(text)
    except ValueError:
        keys = -1
    if keys < 0 or keys % 64:
        raise ValueError(
            f"VEXACT_KEY_SPLIT must be 0 (no split) or a positive multiple of 64 keys (the attention's key "
            f"tile), the same on the trainer and the rollout, got {text!r}"
        )
    if keys and cuda_attention_backend() == "fa4":
        raise ValueError(
            "VEXACT_KEY_SPLIT splits the Triton attention's keys; VEXACT_ATTENTION=fa4 runs FlashAttention-4, "
            "which takes no split: unset VEXACT_KEY_SPLIT or set it to 0"
        )
    return keys
