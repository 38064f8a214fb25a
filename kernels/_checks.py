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
