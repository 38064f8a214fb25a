"""Design C's decode step in CUDA (`incremental_decode.cu`): `decode_weights` writes what
`_decode_weights_kernel` (incremental_decode_triton.py) writes, and `decode_values` then `decode_commit`
what `_decode_kernel` writes, bit for bit, each warp issuing the chunk kernels' instructions on the row
alone (the .cu file says which).
Compiled at first use by NVRTC through torch (`torch.cuda._compile_kernel`); bf16 inputs with d_k = 128 and
d_v a multiple of 64, on CUDA devices with bf16 mma.sync (sm_80 on): `supported` tells, and the Triton
kernels take the rest."""

import functools
from pathlib import Path

import torch

from ..gemm.linear_triton import num_sms
from . import incremental_cache as layout

SOURCE = Path(__file__).with_name("incremental_decode.cu")
D_K = 128
WWARPS = 4  # warps a decode_weights block (the .cu file's WWARPS)
WV = 16  # value columns a warp of decode_values and decode_commit (the .cu file's WV)
BV = 32  # value columns a decode_values block (the .cu file's BV)
BC = 64  # value columns a decode_commit block's tile (the .cu file's BC)
CSEQ = 32  # sequences a decode_commit block looks at, at most (the .cu file's CSEQ)
WEIGHTS_BLOCKS = 5  # decode_weights' blocks an SM, about (39 KB of shared memory each)
WEIGHTS_WAVES = 2  # waves of them past which a block takes all the v heads of its key head
COMMIT_BLOCKS = 8  # decode_commit's blocks an SM, about (28 KB of shared memory each)
_INT32 = 2**31 - 1


def supported(q_hat: torch.Tensor, d_v: int) -> bool:
    """Whether these kernels take a step whose prepared q_hat is [T, HK, DK] and value heads d_v wide."""
    return (
        q_hat.is_cuda
        and q_hat.dtype == torch.bfloat16
        and q_hat.shape[2] == D_K
        and d_v % BC == 0
        and layout.CHUNK == 64
        and torch.cuda.get_device_capability(q_hat.device)[0] >= 8
        and hasattr(torch.cuda, "_compile_kernel")  # torch's NVRTC loader (torch 2.8 on)
    )


@functools.cache
def _kernel(name: str, device_index: int):
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(SOURCE.read_text(), name)


def _int32(what: str, values) -> list[int]:
    values = list(values)
    if max(values) > _INT32:
        raise ValueError(f"{what}: {values} do not fit the kernel's int32 arguments")
    return values


def _int64_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"the per-sequence rows must be contiguous int64 tensors, got {t.dtype} {t.stride()}")


def _rows_aligned(*tensors: torch.Tensor, to: int = 16) -> int:
    """1 where every row the kernels read of these tensors (last dim contiguous) starts on `to` bytes: they
    then move 16 bytes at once (the cache's slots sit at vLLM's page stride, not always a multiple of 16)."""
    return int(all(t.data_ptr() % to == 0 and all(s * t.element_size() % to == 0 for s in t.stride()[:-1])
                   for t in tensors))  # fmt: skip


def weights_heads(n_seqs: int, hv: int, ratio: int, sms: int) -> int:
    """The v heads a decode_weights block takes (of one key head, one after another, the keys staged and
    multiplied once): all `ratio` of them where a block a head would make more than WEIGHTS_WAVES waves of
    WEIGHTS_BLOCKS blocks an SM, else one (a small batch: the heads' chains side by side on more SMs)."""
    return ratio if n_seqs * hv > WEIGHTS_WAVES * WEIGHTS_BLOCKS * sms else 1


def weights_args(q_hat, k_hat, g, beta, cache, start, held, slots, rows, sms: int) -> tuple[int, list]:
    """(grid, arguments) of `decode_weights`: rows = (t_row, w_row, p_row, qg_row) scratch rows [N, HV, ...];
    start, held, slots int64 [N] (slots -1: a padded request, skipped); sms: the device's SMs."""
    n_seqs, hk, hv = start.shape[0], q_hat.shape[1], g.shape[1]
    heads = weights_heads(n_seqs, hv, hv // hk, sms)
    _int64_rows(start, held, slots)
    slot_strides = _int32("slot strides", (t.stride(0) for t in (cache.k, cache.g, cache.beta, cache.t)))
    strides = _int32("strides", (q_hat.stride(0), q_hat.stride(1), k_hat.stride(0), k_hat.stride(1), g.stride(0),
                                 beta.stride(0), n_seqs * hv // heads))  # fmt: skip
    args = [q_hat, k_hat, g, beta, cache.k, cache.g, cache.beta, cache.t, *slot_strides, start, held, slots, *rows,
            n_seqs, *strides[:6], hk, hv, hv // hk, _rows_aligned(cache.k, k_hat, cache.t), heads]  # fmt: skip
    return strides[6], args


def _staged_rows(x: torch.Tensor, cache) -> int:
    """ALIGN16 of `decode_values` and `decode_commit`: 1 where the rows they stage or store (the cache's
    state, state_dt, x and vnew, the step's x) start on 16 bytes, else 0 (4-byte copies; ValueError where
    rows are not 4-byte aligned, which no cache layout of ours produces)."""
    staged = (cache.state, cache.state_dt, cache.x, cache.vnew, x)
    if not _rows_aligned(*staged, to=4):
        raise ValueError("the decode step's staged rows (cache.state, cache.state_dt, cache.x, cache.vnew, x) must "
                         "start on 4-byte boundaries; allocate the cache with IncrementalCache.empty or vLLM's "
                         "hybrid cache")
    return _rows_aligned(*staged)


def values_args(x, out, cache, start, held, slots, read, rows, vn_row) -> tuple[int, list]:
    """(grid, arguments) of `decode_values`: x the prepared dt(beta v) [T, HV, DV]; out [T, HV, DV]; read
    int64 [N] (-1: a zero state); vn_row [N, HV, DV] the completing rows' V' (for `decode_commit`)."""
    n_seqs, hv, d_v = start.shape[0], x.shape[1], x.shape[2]
    _int64_rows(start, held, slots, read)
    slot_strides = _int32("slot strides", (t.stride(0) for t in (cache.state, cache.state_dt, cache.x, cache.vnew)))
    strides = _int32("strides", (x.stride(0), x.stride(1), out.stride(0), out.stride(1), n_seqs * hv * d_v // BV))
    args = [x, out, cache.state, cache.state_dt, cache.x, cache.vnew, *slot_strides, start, held, slots, read, *rows,
            vn_row, n_seqs, *strides[:4], hv, d_v, _staged_rows(x, cache)]  # fmt: skip
    return strides[4], args


def commit_sequences(n_seqs: int, hv: int, sms: int) -> int:
    """Sequences a decode_commit block looks at: the fewest (a power of two, at most CSEQ) that keep its grid
    within one wave of COMMIT_BLOCKS blocks an SM. A block does the work of its sequences that complete a chunk
    one after another, and the others cost it a read: a wave of small groups where every sequence completes at
    once (GRPO's samples of one prompt), no wave of empty blocks where none does."""
    cseq = 1
    while cseq < CSEQ and -(-n_seqs // cseq) * hv > COMMIT_BLOCKS * sms:
        cseq *= 2
    return cseq


def commit_args(k_hat, g, x, cache, start, held, slots, read, vn_row, sms: int) -> tuple[int, list]:
    """(grid, arguments) of `decode_commit`: k_hat, g the prepared rows ([T, HK, DK], [T, HV] fp32); sms: the
    device's SMs."""
    n_seqs, hk, hv, d_v = start.shape[0], k_hat.shape[1], g.shape[1], x.shape[2]
    cseq = commit_sequences(n_seqs, hv, sms)
    slot_strides = _int32("slot strides", (t.stride(0) for t in (cache.state, cache.state_dt, cache.vnew, cache.k,
                                                                 cache.g)))  # fmt: skip
    strides = _int32("strides", (k_hat.stride(0), k_hat.stride(1), g.stride(0), -(-n_seqs // cseq) * hv))
    args = [k_hat, g, cache.state, cache.state_dt, cache.vnew, cache.k, cache.g, *slot_strides, start, held, slots,
            read, vn_row, n_seqs, *strides[:3], hk, hv, d_v, hv // hk, _rows_aligned(cache.k, k_hat),
            _staged_rows(x, cache), cseq]  # fmt: skip
    return strides[3], args


def _launch(name: str, grid: int, warps: int, args: list, device: torch.device) -> None:
    _kernel(name, device.index)(grid=(grid, 1, 1), block=(32 * warps, 1, 1), args=args)


def decode_weights(q_hat, k_hat, g, beta, cache, start, held, slots, rows) -> None:
    """`_decode_weights_kernel`'s work (`weights_args`)."""
    grid, args = weights_args(q_hat, k_hat, g, beta, cache, start, held, slots, rows, num_sms(q_hat.device))
    _launch("decode_weights", grid, WWARPS, args, q_hat.device)


def decode_values(k_hat, g, x, out, cache, start, held, slots, read, rows) -> None:
    """`_decode_kernel`'s work: U, V' and o from `decode_weights`' rows (the products read cache.state_dt,
    half the state's bytes); the row's x and V' to the slot (zeros to the state of a sequence that starts
    here), or the state update of a completed chunk (`decode_commit`, a second launch, a block a v head and
    a few sequences, `commit_sequences`, which does the work of those that complete a chunk)."""
    vn_row = torch.empty(start.shape[0], x.shape[1], x.shape[2], dtype=x.dtype, device=x.device)
    grid, args = values_args(x, out, cache, start, held, slots, read, rows, vn_row)
    _launch("decode_values", grid, BV // WV, args, x.device)
    grid, args = commit_args(k_hat, g, x, cache, start, held, slots, read, vn_row, num_sms(x.device))
    _launch("decode_commit", grid, BC // WV, args, x.device)
