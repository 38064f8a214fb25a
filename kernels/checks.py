"""Launcher-style input checks shared by the kernels: each raises ValueError with a clear message."""

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple = SUPPORTED_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{name} has dtype {t.dtype}; supported: {names}")


def check_int(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} has dtype {t.dtype}; expected torch.int32 or torch.int64")


def check_dim(name: str, t: torch.Tensor, ndim: int, legend: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {legend}, got shape {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"inputs must share one device, got {devices}")


def check_out(
    out: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device, *inputs: torch.Tensor | None
) -> None:
    """A kernel's `out=`: None, or a contiguous tensor of the result's shape, dtype and device (the
    result is written there, with the bits it has without `out=`); inference only, so neither `out`
    nor any of `inputs` may need a gradient."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()} on {out.device}"
        )
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (out, *inputs)):
        raise ValueError("out= is for inference: no input or output may need a gradient")
