"""FlashAttention-4 (flash-attn-4, CuTe DSL) as the one attention of both sides on Hopper (SM90).

Chosen with VEXACT_ATTENTION=fa4 (`dispatch.attention_backend_for`), in the trainer and the rollout
alike: it replaces the Triton kernels for `varlen_attention` (training, forward and deterministic
backward) and `paged_attention` (prefill, chunked prefill, decode), so every query reduces its keys
in FA4's order on either side. docs/architecture.md#flashattention-4 reads its SM90 source: at head dim 128 one 128 x 128
tile configuration whatever the shapes, key blocks anchored at key 0 taken in descending order from the
row's own block, a per-row online softmax. `benchmarks/fa4_bits.py` compares bits per row (H100,
4.0.0b36: 0 rows differ between the training call, paged prefill at pages of 16 and 128, chunked
prefill from unaligned starts and decode).

Every call passes causal=True, num_splits=1 (no split of the keys), pack_gqa=True and the one softmax
scale. The bits belong to this exact FA4 build (its DSL compiles the kernels): `FA4_VERSION` is
pinned and checked, and only SM90 is allowed (other architectures run other kernels).
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch

from ..settings import get_settings

FA4_VERSION = "4.0.0b36"
_CAPABILITIES = ((9, 0),)
_DTYPES = (torch.bfloat16,)  # the dtype the CUDA tests compare; fp16 after they cover it
# Tested bitwise on the H100 at 128 only (FA4's SM90 tile there: 128 x 128). Head dims 64 and 96 run
# 192 x 128 tiles whose rows are not yet tested; add them after tests/kernels/attention/test_fa4.py
# covers them.
_HEAD_DIMS = (128,)


@functools.cache
def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def check_value_head_size(q: torch.Tensor, head_dim_v: int) -> None:
    """ValueError where the values' head size differs from the queries' (DeepSeek's MLA: 192 and 128):
    FA4 has a kernel for that shape, but its bits are not tested against the contract."""
    if head_dim_v != q.shape[-1]:
        raise ValueError(
            f"VEXACT_ATTENTION=fa4 takes equal query/key and value head sizes; this model has {q.shape[-1]} and "
            f"{head_dim_v} (MLA): FA4's path for different head sizes is not tested bitwise. Unset "
            "VEXACT_ATTENTION (the Triton attention) on both the trainer and the rollout"
        )


def check_usable(q: torch.Tensor) -> None:
    """ValueError, saying what to do, where VEXACT_ATTENTION=fa4 cannot keep the contract for q."""
    hint = "or unset VEXACT_ATTENTION (the Triton attention) on both the trainer and the rollout"
    version = _installed_version()
    if version != FA4_VERSION:
        found = "is not installed" if version is None else f"is {version}"
        raise ValueError(
            f"VEXACT_ATTENTION=fa4 needs flash-attn-4=={FA4_VERSION} (with nvidia-cutlass-dsl); it {found}. "
            f"Install that version, {hint}"
        )
    capability = _capability(q.device.index) if q.device.type == "cuda" else None  # once a device: every layer calls
    if capability not in _CAPABILITIES:
        where = q.device if capability is None else f"sm_{''.join(map(str, capability))}"
        raise ValueError(f"VEXACT_ATTENTION=fa4 runs on Hopper GPUs (sm_90) only, not on {where}; {hint}")
    get_settings()  # a key split with fa4 is refused there, with a message, never ignored
    if q.dtype not in _DTYPES or q.shape[-1] not in _HEAD_DIMS:
        raise ValueError(
            f"VEXACT_ATTENTION=fa4 takes bf16 with head_dim in {_HEAD_DIMS}, got {q.dtype} and "
            f"head_dim {q.shape[-1]}; {hint}"
        )


def _call(q, k, v, scale, **kwargs):
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q, k, v, softmax_scale=scale, causal=True, num_splits=1, pack_gqa=True, **kwargs
    )
    return out[0] if isinstance(out, tuple) else out


def varlen_attention(q, k, v, cu_seqlens, scale, longest=None):
    """`causal.varlen_attention` on FA4 (inputs already checked there); differentiable, with FA4's
    deterministic backward. `longest`: the longest sequence, if the caller has it (else read here)."""
    check_usable(q)
    check_value_head_size(q, v.shape[-1])
    cu = cu_seqlens.to(torch.int32)
    if longest is None:
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    if q.shape[0] == 0 or longest == 0:
        return torch.zeros_like(q)
    return _call(
        q, k, v, scale, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        deterministic=True,
    )  # fmt: skip


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None, shared=None, max_query_len=None
):
    """`causal.paged_attention` on FA4 (inputs already checked there). No host synchronisation:
    the longest query count is bounded by `max_query_len` where the caller knows it for this launch
    alone (an eager step), else by T; the key count by the block table's width. So a CUDA graph
    captured for T tokens serves every batch of T tokens. FA4's grid follows the bound (its empty
    query blocks exit), no value does. `shared` only lays out the Triton kernel's programs; FA4 has
    its own and takes none."""
    check_usable(q)
    if shared is not None:
        raise ValueError(
            "VEXACT_ATTENTION=fa4 does not take shared-prompt groups: unset VEXACT_SHARED_PREFIX with it"
        )
    check_value_head_size(q, v_cache.shape[-1])
    n_tokens = q.shape[0]
    result = torch.zeros_like(q) if out is None else out
    if n_tokens == 0 or seq_lens.shape[0] == 0:
        return result
    attended = _call(
        q, k_cache, v_cache, scale,
        cu_seqlens_q=query_start_loc.to(torch.int32), max_seqlen_q=min(max_query_len or n_tokens, n_tokens),
        seqused_k=seq_lens.to(torch.int32), page_table=block_table[: seq_lens.shape[0]].to(torch.int32),
    )  # fmt: skip
    return result.copy_(attended)
