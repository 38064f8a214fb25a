"""Tensor parallelism that keeps the trainer's bits: every sharded layer is column-parallel.

Legend: T ranks, r this rank, M tokens, K a GEMM's reduction, N its output columns.

Rule: a rank never reduces over a part of K. Each sharded GEMM computes a contiguous block of the
whole layer's output columns with the FULL K, with the launch configuration of the whole weight
(`linear(..., config_n=N)`), so each output element is reduced in exactly the order of the
unsharded GEMM the trainer (FSDP, TP = 1) runs: column n's bits do not depend on which other columns
a launch computes (kernels.gemm.linear). Where vLLM's layers are row-parallel (o_proj, down_proj: K split
over ranks, an all-reduce), the input is all-gathered first and the layer is column-sharded too:
    attention   q/k/v: the rank's heads (column shard)      -> attention over the rank's heads
                gather the heads (rank order = head order)  -> o_proj: the rank's H / T columns
                gather -> the full [M, H] on every rank
    MLP         gate/up: the rank's I / T columns each      -> SiLU-and-mul on them
                gather -> [M, I]                            -> down_proj: the rank's H / T columns
                gather -> [M, H]
    MoE         the same per expert (experts' I and H sharded); routing on the full hidden state
    Gated       in_proj: the rank's key heads and their value heads (conv channels, gates, recurrence
    DeltaNet    per head) -> gather the heads -> out_proj: the rank's H / T columns -> gather
    lm_head     the rank's vocabulary columns               -> gather -> full fp32 logits [M, V]
An all-gather moves data and adds nothing, so its result is exact whatever the communication
algorithm, the message size or the topology. No partial sums are ever reduced. Where the group has a
fast all-reduce for a message (vLLM's custom all-reduce over IPC buffers, one kernel, inside CUDA
graphs too: the decode steps' small messages), the gather is that all-reduce of a buffer holding this
rank's block and -0.0 everywhere else: -0.0 is the additive identity of every value (x + -0.0 is x,
bit for bit, for +0.0, -0.0, subnormals, inf and NaN), so the sum is the gathered blocks, exactly,
given a reduction that does not flush subnormals (proved on the GPUs:
tests/vexact_vllm/test_tp_exchange_cuda.py). Exact already without
any of this: the embedding (a gather of rows; replicated), the norms and the residual adds (on the
full [M, H], replicated: the same inputs and ops on every rank), q/k RMSNorm and RoPE (per head),
attention (per head: a rank attends over its heads' keys only, as the trainer does per head),
SiLU-and-mul (elementwise), the routing (from the full hidden state on every rank).

Shards are `torch.tensor_split` blocks (the first N % T ranks one column larger). Query heads must
split evenly; key/value heads split evenly or, when there are fewer than T, are replicated (rank r
holds kv head r * Hkv // T, the one its query heads use), as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import UnsupportedModelError


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the group and the group's collectives (vLLM's tensor-parallel group
    provides them; tests emulate them).

    `all_gather(x)`: x [..., n] on every rank (same n) -> [..., T n], rank r's x at columns
    [r n, (r + 1) n). `all_reduce(buf)`: the elementwise sum of every rank's buf, for the buffers
    `reduces(buf)` accepts (its fast path: messages under `reduce_bytes`); without them every gather
    is an all-gather.

    The sum's buffers persist, one per (n, dtype, device), with rows for the largest message the
    fast path takes: -0.0 written once, when the first message of that width arrives (vLLM's
    profile run, before any CUDA graph is captured: a buffer first allocated during a capture would
    live in the graphs' shared pool, so a capture gets a per-call buffer instead). A rank only ever
    writes its own block's columns, so the rest stays -0.0 and needs no fill per message."""

    rank: int
    size: int
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    reduces: Callable[[torch.Tensor], bool] | None = None
    reduce_bytes: int = 0
    buffers: dict = field(default_factory=dict, compare=False, repr=False)

    def bounds(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's block of n columns (torch.tensor_split's blocks)."""
        return shard_bounds(n, self.size, self.rank)

    def take(self, full: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's block of `full` along `dim` (a view)."""
        start, stop = self.bounds(full.shape[dim])
        return full.narrow(dim, start, stop - start)

    def take_halves(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """A [gate; up] stacked tensor's rank block: this rank's block of each half, stacked again."""
        gate, up = full.chunk(2, dim)
        return torch.cat([self.take(gate, dim), self.take(up, dim)], dim)

    def block_buffer(self, rows: int, n: int, like: torch.Tensor) -> torch.Tensor | None:
        """A [rows, n] buffer of `like`'s dtype and device for the sum exchange, -0.0 outside this
        rank's block (`bounds(n)`), whose block the caller fills before `all_reduce`; None where the
        message goes by all-gather (no fast all-reduce, or too large for it)."""
        if self.all_reduce is None or rows * n * like.element_size() >= self.reduce_bytes:
            return None
        key = (n, like.dtype, like.device)
        kept = self.buffers.get(key)
        if kept is None and not (like.is_cuda and torch.cuda.is_current_stream_capturing()):
            kept = self.buffers[key] = like.new_full(((self.reduce_bytes - 1) // (n * like.element_size()), n), -0.0)
        if kept is not None:
            buf = kept[:rows]
        else:  # first met inside a CUDA graph capture: this call's own buffer
            start, stop = self.bounds(n)
            buf = like.new_empty((rows, n))
            buf[:, :start].fill_(-0.0)
            buf[:, stop:].fill_(-0.0)
        return buf if self.reduces(buf) else None

    def gather_output(self, produce: Callable[[torch.Tensor | None], torch.Tensor], rows: int, n: int,
                      like: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """`gather(produce(None), n)`, where `produce(out)` computes this rank's [rows, block] (into
        `out` when given: then straight into the sum exchange's buffer, no copy). `like`: a tensor
        of the output's dtype and device."""
        buf = self.block_buffer(rows, n, like) if self.size > 1 else None
        if buf is None:
            return self.gather(produce(None), n)
        start, stop = self.bounds(n)
        produce(buf[:, start:stop])
        return self.all_reduce(buf)

    def gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[..., n] from every rank's block x [..., bounds(n)]: the blocks in rank order. Through the
        all-reduce where it takes the message (see the module's docstring), else the all-gather, whose
        uneven blocks are padded to the largest and the padding dropped after."""
        if self.size == 1:
            return x
        rows = math.prod(x.shape[:-1])
        buf = self.block_buffer(rows, n, x)
        if buf is not None:  # this block, -0.0 (the additive identity) elsewhere, summed
            start, stop = self.bounds(n)
            buf[:, start:stop].copy_(x.reshape(rows, x.shape[-1]))
            return self.all_reduce(buf).view(*x.shape[:-1], n)
        width = -(-n // self.size)
        if n % self.size == 0:
            return self.all_gather(x.contiguous())
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        every = self.all_gather(padded.contiguous())  # [..., T * width]
        blocks = [every[..., r * width : r * width + (b - a)] for r, (a, b) in
                  enumerate(shard_bounds(n, self.size, r) for r in range(self.size))]  # fmt: skip
        return torch.cat(blocks, -1)


def shard_bounds(n: int, size: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def kv_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first kv head, number of kv heads) rank `tp.rank` holds; refuses splits the heads cannot take."""
    if num_heads % tp.size:
        raise UnsupportedModelError(
            f"--tensor-parallel-size {tp.size} does not divide the {num_heads} attention heads; use a "
            "tensor-parallel size that divides num_attention_heads"
        )
    if num_kv_heads % tp.size == 0:
        per_rank = num_kv_heads // tp.size
        return tp.rank * per_rank, per_rank
    if tp.size % num_kv_heads == 0:
        return tp.rank * num_kv_heads // tp.size, 1
    raise UnsupportedModelError(
        f"--tensor-parallel-size {tp.size} neither divides nor is a multiple of the {num_kv_heads} key/value "
        "heads; use a tensor-parallel size that divides num_key_value_heads or is a multiple of it"
    )


def check_tensor_parallel(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Refuse a tensor-parallel size the attention heads cannot be split by (before any engine starts)."""
    if size > 1:
        kv_heads(num_heads, num_kv_heads, TensorParallel(0, size, _no_gather))


def _no_gather(x):
    raise AssertionError("not a real group")


def mark_shard(
    param: torch.nn.Parameter, take: Callable[[torch.Tensor], torch.Tensor], take_expert=None
) -> None:
    """Tell the loader how to cut this rank's block from the whole Hugging Face tensor (`take_expert`:
    from one expert's tensor, for a stacked expert parameter)."""
    param.tp_take, param.tp_take_expert = take, take_expert


def shard_of(param: torch.nn.Parameter, full: torch.Tensor, expert: bool = False) -> torch.Tensor:
    """The part of a whole checkpoint tensor (`expert`: of one expert's tensor) this rank's parameter
    holds; all of it if the parameter is not sharded."""
    take = getattr(param, "tp_take_expert" if expert else "tp_take", None)
    return full if take is None else take(full)
