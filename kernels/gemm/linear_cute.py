"""The linear forward on Hopper through quack's CuTe-DSL GEMMs: the Triton kernel's bits, faster where
no tuned Triton tile exists.

Why the bits are the Triton kernel's: on an SM90 GPU a bf16 GEMM that neither splits K nor starts a
second accumulator reduces each output element as ONE chain of wgmma instructions of k = 16 on an
fp32 accumulator, in K order, from the first column (linear_triton.py's docstring: BLOCK_K only
groups that chain). quack's SM90 kernels (`split_k=1`) are such GEMMs whatever their tile, cluster,
pingpong or cooperative schedule, or operand swap (`swap_ab`: D^T = W x^T; an MMA's products and
their order do not depend on which operand it reads as A); the rounding to the output dtype and the
bias (fp32, after the K loop) are the Triton kernel's too. The CUDA tests hold this bit for bit
(tests/kernels/gemm/test_linear_cute.py: every configuration this module picks, random shapes, rows of
zeros, bias, fp32 output, a column block of a wider output, CUDA graphs).

So the configuration may follow M: `cute_config` picks, from the output's tile counts alone, a
swapped 128 x 64 tile for decode batches (M <= 64: the weight's rows fill the SMs) and the largest of
three tiles that still gives the SMs enough tiles for larger M.

Where it runs (`takes`): an SM90 device (Hopper: what the tests cover), bf16 operands (fp32 operands
would run TF32 MMAs), a bf16 or fp32 output, operands and output whose base and rows are 16-byte
aligned (TMA), compact operand rows (the output may be a column block of a wider tensor), no K split
in the shape's Triton reduction (`k_split == 1`), and a weight shape with no tuned Triton tiles
(`linear_triton._TUNED`: there the Triton tiles are as fast). quack is part of the `gpu` extra
(`scripts/gpu-quack.sh` brings it to a host without network); without it every call takes the
Triton kernel, with the same bits.
"""

from __future__ import annotations

import functools

import torch

# (tile_m, tile_n, pingpong, cluster_m, cluster_n, swap_ab): quack's GemmConfig fields. Swapped tiles
# put the weight's rows on tile_m and the batch rows on tile_n.
SWAP_128x64 = (128, 64, True, 2, 1, True)
SWAP_128x128 = (128, 128, True, 1, 1, True)
WIDE_128x192 = (128, 192, True, 2, 1, False)
CONFIGS = (SWAP_128x64, SWAP_128x128, WIDE_128x192)
DECODE_ROWS = 64  # up to this many rows the swapped 128 x 64 tile


def cute_config(m: int, n: int, sms: int) -> tuple:
    """The configuration for [m, n] outputs on `sms` multiprocessors: speed only (every one has the
    same bits). Above DECODE_ROWS rows, the widest tile that still makes at least half as many tiles
    as there are SMs (timed on an H200 over Qwen3-8B shards and Qwen3.5-4B shapes)."""
    if m <= DECODE_ROWS:
        return SWAP_128x64
    for cfg in (WIDE_128x192, SWAP_128x128):
        if _tiles(m, n, cfg) * 2 >= sms:
            return cfg
    return SWAP_128x64


def _tiles(m: int, n: int, cfg: tuple) -> int:
    tile_m, tile_n, *_, swap = cfg
    rows, cols = (n, m) if swap else (m, n)
    return -(-rows // tile_m) * -(-cols // tile_n)


def warmup_rows(n: int, sms: int) -> list[int]:
    """One M per configuration `cute_config` can pick for n output columns (the smallest), so a
    warm-up call at each compiles every kernel a batch of n columns can reach."""
    rows, seen = [], set()
    # The tile counts are functions of ceil(M / 64), and from 64 * sms rows on the widest tile fills half.
    for m in range(1, 64 * max(sms, 1) + 2, 64):
        cfg = cute_config(m, n, sms)
        if cfg not in seen:
            seen.add(cfg)
            rows.append(m)
    return rows


def aligned(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can address: unit last stride, 16-byte aligned base and row stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


@functools.cache
def _quack():
    """quack's (gemm_tuned, GemmConfig), or None where it is not installed."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_tuned
    except ImportError:
        return None
    return gemm_tuned, GemmConfig


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def takes(x2: torch.Tensor, weight: torch.Tensor, bias, y: torch.Tensor) -> bool:
    """Whether a launch the caller found untuned (no tuned Triton tiles, no K split) runs here (see the
    module's docstring)."""
    return (
        x2.is_cuda
        and x2.dtype == torch.bfloat16
        and _hopper(x2.device)
        and all(aligned(t) for t in (x2, weight, y))
        and x2.stride(0) == x2.shape[1] and weight.stride(0) == weight.shape[1]  # compact operands (tested)
        and (bias is None or (bias.dtype == x2.dtype and bias.data_ptr() % 16 == 0))
        and _quack() is not None
    )


@functools.cache
def _config(cfg: tuple):
    tile_m, tile_n, pingpong, cluster_m, cluster_n, swap = cfg
    return _quack()[1](tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=cluster_m, cluster_n=cluster_n,
                       swap_ab=swap, is_dynamic_persistent=False, device_capacity=9)  # fmt: skip


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, sms: int,
           cfg: tuple | None = None) -> None:  # fmt: skip
    """y [M, N] = x2 [M, K] @ weight [N, K]^T (+ bias) with `cfg` (default: `cute_config`)."""
    cfg = cute_config(x2.shape[0], weight.shape[0], sms) if cfg is None else cfg
    _quack()[0].fn(x2, weight.t(), y, C=None, bias=bias, config=_config(cfg), split_k=1)
