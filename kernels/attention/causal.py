"""Causal attention with one position-anchored reduction order, shared by training and inference.

Math, for a query q at absolute position p of a sequence with keys/values k_j, v_j (j = 0..p),
query head h reading kv head h // (Hq / Hkv) (grouped-query attention), D = the query/key head
size and Dv = the value head size (Dv = D for most models; DeepSeek's latent, one key head of
D = C + R whose first C dims are the values: Dv = C, latent.py):
    s_j = (sum_{d < D} fp32(q[d]) * fp32(k_j[d])) * scale              fp32 scores
    m   = max_{j <= p} s_j                                               exact, order-free
    e_j = exp(s_j - m) for j <= p, else 0
    keys in tiles of KEY_TILE = 64 anchored at position 0: tile t = positions 64t .. 64t + 63
    l_t = sum_{j in t} e_j,   o_t[d] = sum_{j in t} e_j * fp32(v_j[d])    (64-long sums, zero-padded; d < Dv)
    l = o = 0; for t = 0, 1, ..., p // 64:  l = l + l_t,  o = o + o_t    (sequential, in tile order)
    out = (o / l).to(q.dtype)

Invariant: every sum above has a fixed length (D for the scores, exactly KEY_TILE within a tile)
and runs over the contiguous last dim (`reduction.row_sum`); the tiles are added one by one in
absolute order; key slots past p contribute an exact +0.0 (masked with `torch.where`, so garbage or
NaN in unused cache slots never enters) and tiles past p's own tile are skipped with `torch.where`
(no +0.0 is ever added). So out(p, h) depends only on q[p, h] and K/V at positions 0..p: not on the
sequence length, the other queries of the call, the query chunking, the KV-cache block size, or the
entry point (`varlen_attention` for training, `paged_attention` for decode, prefill and chunked
prefill). The softmax max m is a true max over the same set, hence the same bits everywhere.

Gradients of `varlen_attention` flow through the torch ops (correct, deterministic). On CUDA the
Triton kernels run the same contract with their own fixed order (core_triton.py); the latent takes
them too (one load of a key row for both products), FA4 refuses it.
"""

import importlib

import torch

from ..checks import (
    check_dim,
    check_dtype,
    check_int,
    check_last_dim_contiguous,
    check_same_device,
)
from ..dispatch import attention_backend_for, backend_for
from ..reduction import row_sum
from .latent import values_in_keys
from .tiles import KEY_TILE

# Queries handled together at most (results do not depend on it).
_QUERY_CHUNK = 64
# Largest [C, Hkv, G, tiles, 64, max(D, Dv)] fp32 product formed at once (elements; results do not
# depend on it): 1 MiB stays in a core's L2 cache, so the product, its mask and its sum run from the
# cache: 3x less CPU time than 1 << 22 on a 150-token prefill of DeepSeek's 576-wide latent and on
# 300 tokens of 16 heads x 128 dims, the same on decode and on narrow heads.
_PRODUCT_BUDGET = 1 << 18


def _attend(q: torch.Tensor, kf: torch.Tensor, v_t: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """Consecutive queries of ONE sequence over its keys, in the reduction order described above.

    C = queries, at absolute positions first_pos .. first_pos + C - 1; G = Hq / Hkv; NT = key tiles
    up to the last query's tile. q: [C, Hq, D]; kf: fp32 keys [>= NT * 64, Hkv, D] (positions from 0,
    zero past the sequence); v_t: fp32 values by tile [Hkv, >= NT, Dv, 64] (`_float_tiles`) ->
    [C, Hq, Dv] in q.dtype.
    """
    n_q, n_heads, head_dim = q.shape
    n_kv, head_dim_v = kf.shape[1], v_t.shape[2]
    group = n_heads // n_kv
    q_pos = torch.arange(n_q, device=q.device) + first_pos  # [C]
    n_tiles = (first_pos + n_q - 1) // KEY_TILE + 1
    n_keys = n_tiles * KEY_TILE
    qf = q.float().reshape(n_q, n_kv, group, 1, head_dim)  # [C, Hkv, G, 1, D]
    k_t = kf[:n_keys].permute(1, 0, 2)  # [Hkv, NT * 64, D]
    v_t = v_t[:, :n_tiles]  # [Hkv, NT, Dv, 64]
    key_pos = torch.arange(n_keys, device=q.device)
    mask = (key_pos[None, :] <= q_pos[:, None]).reshape(n_q, 1, 1, n_tiles, KEY_TILE)  # [C, 1, 1, NT, 64]
    # Tiles per group of the [C, Hkv, G, tiles, 64, max(D, Dv)] product (`_PRODUCT_BUDGET`).
    step = max(1, _PRODUCT_BUDGET // (n_q * n_heads * KEY_TILE * max(head_dim, head_dim_v)))

    # 1. Scores (D-long dot products), -inf past each query's position (padding included).
    dots = torch.cat(
        [
            row_sum(qf * k_t[None, :, None, t0 * KEY_TILE : (t0 + step) * KEY_TILE, :])
            for t0 in range(0, n_tiles, step)
        ],
        dim=-1,
    ).reshape(n_q, n_kv, group, n_tiles, KEY_TILE)  # [C, Hkv, G, NT, 64]
    scores = torch.where(mask, dots * scale, float("-inf"))

    # 2. Exact row max (detached: the softmax is shift-invariant) and weights, exactly 0 where masked.
    m = scores.amax(dim=(-2, -1), keepdim=True).detach()  # [C, Hkv, G, 1, 1]
    e = torch.exp(scores - m)  # [C, Hkv, G, NT, 64]

    # 3. Per-tile 64-long sums of e and of e * v (masked slots contribute an exact +0.0; tiles whose
    #    keys all sit at or before the first query need no mask: `where` would return the product).
    l_tiles = row_sum(e)  # [C, Hkv, G, NT]
    o_parts = []
    for t0 in range(0, n_tiles, step):
        part = e[:, :, :, t0 : t0 + step, None, :] * v_t[None, :, None, t0 : t0 + step]  # [C, Hkv, G, tiles, Dv, 64]
        if min(t0 + step, n_tiles) * KEY_TILE > first_pos + 1:
            part = torch.where(mask[:, :, :, t0 : t0 + step, None, :], part, 0.0)
        o_parts.append(row_sum(part))  # [C, Hkv, G, tiles, Dv]
    o_tiles = torch.cat(o_parts, dim=3)  # [C, Hkv, G, NT, Dv]

    # 4. Tiles added one by one in absolute order; a tile past the query's own tile is skipped.
    l_acc = torch.zeros(n_q, n_kv, group, device=q.device)  # [C, Hkv, G]
    o_acc = torch.zeros(n_q, n_kv, group, head_dim_v, device=q.device)  # [C, Hkv, G, Dv]
    for t in range(n_tiles):
        in_range = (t * KEY_TILE <= q_pos)[:, None, None]  # [C, 1, 1]
        l_acc = torch.where(in_range, l_acc + l_tiles[..., t], l_acc)
        o_acc = torch.where(in_range[..., None], o_acc + o_tiles[..., t, :], o_acc)

    # 5. Normalise and cast.
    out = o_acc / l_acc[..., None]  # [C, Hkv, G, Dv]
    return out.reshape(n_q, n_heads, head_dim_v).to(q.dtype)


def _out_shape(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    """[T, Hq, Dv]: the output of queries q [T, Hq, D] over values v [..., Hkv, Dv]."""
    return (q.shape[0], q.shape[1], v.shape[-1])


def _float_tiles(k, v, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [L, Hkv, D], v [L, Hkv, Dv] -> fp32 keys [NT * 64, Hkv, D] and values by tile [Hkv, NT, Dv, 64]
    (a view), zero-padded past L to NT whole tiles (the first NT * 64 positions when L is longer)."""
    n_keys = n_tiles * KEY_TILE
    kf, vf = k[:n_keys].float(), v[:n_keys].float()
    if kf.shape[0] < n_keys:  # zero-pad the last tile
        kf = torch.cat([kf, kf.new_zeros(n_keys - kf.shape[0], *kf.shape[1:])])  # [NT * 64, Hkv, D]
        vf = torch.cat([vf, vf.new_zeros(n_keys - vf.shape[0], *vf.shape[1:])])  # [NT * 64, Hkv, Dv]
    return kf, vf.reshape(n_tiles, KEY_TILE, *vf.shape[1:]).permute(2, 0, 3, 1)


def _attend_sequence(q, k, v, q_start_pos: int, scale: float) -> torch.Tensor:
    """Queries q [Q, Hq, D] at positions q_start_pos .. q_start_pos + Q - 1 of a sequence whose keys
    k [L, Hkv, D] and values v [L, Hkv, Dv] hold positions 0 .. L - 1 (L >= q_start_pos + Q), in
    query chunks (at most _QUERY_CHUNK, fewer where one query's product over a tile is large) over
    keys and values made fp32 once."""
    if q.shape[0] == 0:
        return q.new_empty(_out_shape(q, v))
    n_heads, width = q.shape[1], max(q.shape[2], v.shape[2])
    chunk = max(1, min(_QUERY_CHUNK, _PRODUCT_BUDGET // (n_heads * KEY_TILE * width)))
    kf, v_t = _float_tiles(k, v, (q_start_pos + q.shape[0] - 1) // KEY_TILE + 1)
    return torch.cat([
        _attend(q[c0 : c0 + chunk], kf, v_t, q_start_pos + c0, scale) for c0 in range(0, q.shape[0], chunk)
    ])  # fmt: skip


def _varlen_attention_torch(q, k, v, cu_seqlens, scale, longest=None):  # longest: unused here
    bounds = [int(b) for b in cu_seqlens.tolist()]
    outs = []
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        outs.append(_attend_sequence(q[lo:hi], k[lo:hi], v[lo:hi], 0, scale))
    if not outs:
        return q.new_empty(_out_shape(q, v))
    return torch.cat(outs)


def _write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping):
    valid = slot_mapping >= 0  # [T]
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    n_slots = k_cache.shape[0] * block_size
    if slots.numel() > 0 and int(slots.max()) >= n_slots:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())} but the cache has {n_slots} slots")
    blocks, offsets = slots // block_size, slots % block_size  # caches may be strided views
    k_cache[blocks, offsets] = k[valid]
    v_cache[blocks, offsets] = v[valid]


def _paged_attention_torch(
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, out=None, shared=None, max_query_len=None
):
    del shared, max_query_len  # one sequence after another: the layout of the work changes no value
    block_size = k_cache.shape[1]
    lens = [int(n) for n in seq_lens.tolist()]
    starts = [int(s) for s in query_start_loc.tolist()]
    out = q.new_empty(_out_shape(q, v_cache)) if out is None else out
    for b, seq_len in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        if hi - lo > seq_len:
            raise ValueError(f"sequence {b}: {hi - lo} queries but seq_lens[{b}] = {seq_len}")
        n_blocks = -(-seq_len // block_size)
        if n_blocks > block_table.shape[1]:
            raise ValueError(
                f"sequence {b}: seq_len {seq_len} needs {n_blocks} blocks, block_table has {block_table.shape[1]}"
            )
        pos = torch.arange(seq_len, device=q.device)  # [L]
        blocks, offsets = block_table[b, pos // block_size].long(), pos % block_size  # [L]
        keys, values = k_cache[blocks, offsets], v_cache[blocks, offsets]  # [L, Hkv, D], [L, Hkv, Dv]
        out[lo:hi] = _attend_sequence(q[lo:hi], keys, values, seq_len - (hi - lo), scale)
    return out


def _lazy_impl(module: str, name: str):
    """<module>.<name>, imported on first call: importing this module never imports triton or FA4."""

    def run(*args, **kwargs):
        return getattr(importlib.import_module(f".{module}", __package__), name)(*args, **kwargs)

    run.__name__ = f"_{name}_{module}"
    return run


_VARLEN_IMPLS = {
    "torch": _varlen_attention_torch,
    "triton": _lazy_impl("varlen_triton", "varlen_attention"),
    "fa4": _lazy_impl("fa4", "varlen_attention"),
}
_WRITE_IMPLS = {"torch": _write_kv_cache_torch, "triton": _lazy_impl("paged_triton", "write_kv_cache")}
_PAGED_IMPLS = {
    "torch": _paged_attention_torch,
    "triton": _lazy_impl("paged_triton", "paged_attention"),
    "fa4": _lazy_impl("fa4", "paged_attention"),
}


def _check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: tuple[str, str], legend: str
) -> None:
    k_name, v_name = names
    check_dtype("q", q)
    check_dtype(k_name, k)
    check_dtype(v_name, v)
    check_dim("q", q, 3, "[T, Hq, D]")
    check_dim(k_name, k, legend.count(",") + 1, legend)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, {k_name}, {v_name} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)} must have the same shape but for the last "
            "dim (the value head size may differ from the query/key head size)"
        )
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{k_name} head_dim {k.shape[-1]} differs from q head_dim {head_dim}")
    if v.shape[-1] < 1:
        raise ValueError(f"{v_name} must have a positive value head size, got {tuple(v.shape)}")
    if n_kv == 0 or n_heads % n_kv != 0:
        raise ValueError(f"Hq = {n_heads} must be a multiple of Hkv = {n_kv}")
    check_last_dim_contiguous("q", q)


def _backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """`attention_backend_for(q)`, refusing FA4 for the latent (values in the keys: DeepSeek's MLA),
    which its kernels do not take."""
    backend = attention_backend_for(q)
    if backend == "fa4" and values_in_keys(k, v):
        raise ValueError(
            "VEXACT_ATTENTION=fa4 does not take DeepSeek's latent (MLA) attention; unset VEXACT_ATTENTION "
            "(the Triton kernels serve it) on both the trainer and the rollout side"
        )
    return backend


def _check_scale(scale: float) -> None:
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention over packed sequences (training layout).

    q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, Dv] (bf16/fp32, one dtype; Dv may differ from D),
    cu_seqlens: int [B + 1] with cu_seqlens[0] = 0 and cu_seqlens[B] = T; token i of sequence b
    (row cu[b] + i) sits at absolute position i. Returns [T, Hq, Dv] in q.dtype. Differentiable.
    """
    _check_qkv(q, k, v, ("k", "v"), "[T, Hkv, D]")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens, k/v have {k.shape[0]}")
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    check_int("cu_seqlens", cu_seqlens)
    check_dim("cu_seqlens", cu_seqlens, 1, "[B + 1]")
    bounds = cu_seqlens.tolist()
    if (
        not bounds
        or bounds[0] != 0
        or bounds[-1] != q.shape[0]
        or any(a > b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {q.shape[0]}, got {bounds}")
    _check_scale(scale)
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    longest = max((b - a for a, b in zip(bounds, bounds[1:], strict=False)), default=0)  # no sync: bounds are here
    return _VARLEN_IMPLS[_backend(q, k, v)](q, k, v, cu_seqlens, float(scale), longest=longest)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k [T, Hkv, D], v [T, Hkv, Dv] in k_cache [num_blocks, block_size, Hkv, D], v_cache
    [num_blocks, block_size, Hkv, Dv] (in place; Dv may differ from D).

    slot_mapping: int [T], slot = block * block_size + offset; negative slots (padding) are skipped.
    """
    check_dtype("k", k)
    check_dtype("v", v)
    check_dtype("k_cache", k_cache)
    check_dtype("v_cache", v_cache)
    check_dim("k", k, 3, "[T, Hkv, D]")
    check_dim("v", v, 3, "[T, Hkv, Dv]")
    check_dim("k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    check_dim("v_cache", v_cache, 4, "[num_blocks, block_size, Hkv, Dv]")
    if (
        k.shape[:-1] != v.shape[:-1]
        or k_cache.shape[:-1] != v_cache.shape[:-1]
        or tuple(k.shape[1:]) != tuple(k_cache.shape[2:])
        or tuple(v.shape[1:]) != tuple(v_cache.shape[2:])
    ):
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, Hkv, D], [T, Hkv, Dv] matching caches "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} [num_blocks, block_size, Hkv, D or Dv]"
        )
    if len({k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(
            f"k, v and the caches must share one dtype, got {k.dtype}, {v.dtype}, {k_cache.dtype}"
        )
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)
    check_int("slot_mapping", slot_mapping)
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"slot_mapping must have shape ({k.shape[0]},), got {tuple(slot_mapping.shape)}")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    _WRITE_IMPLS[backend_for(k)](k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    shared=None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new queries over a paged KV cache (inference; no gradient).

    q: [T, Hq, D]; k_cache: [num_blocks, block_size, Hkv, D], v_cache: [num_blocks, block_size,
    Hkv, Dv] (Dv may differ from D) already holding the new keys and values;
    block_table: int [B, max_blocks]; seq_lens: int [B] (keys per sequence, new ones included);
    query_start_loc: int [B + 1]. The queries of sequence b are its LAST q_len tokens, so query i
    sits at absolute position seq_lens[b] - q_len + i. Returns [T, Hq, Dv] in q.dtype, bitwise equal
    to `varlen_attention` on the same values. `out`: an optional [T, Hq, Dv] tensor of q's dtype and
    device (last dim contiguous, rows and heads may be strided, e.g. a view of the caller's output
    buffer) written in place and returned instead of a new tensor. `shared`:
    `prefix.shared_prefix_groups` of this step's block_table, seq_lens and query_start_loc
    (decode sequences reading the same cache blocks, attended once per group on CUDA), or None: the
    same bits either way; built for other inputs, it gives wrong values (not checked: that would sync).
    `max_query_len`: a host bound on the longest sequence's query count (None: T), which sizes FA4's
    grid (VEXACT_ATTENTION=fa4) and no value; a launch a CUDA graph replays must leave it None.
    """
    _check_qkv(q, k_cache, v_cache, ("k_cache", "v_cache"), "[num_blocks, block_size, Hkv, D]")
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)
    check_int("block_table", block_table)
    check_int("seq_lens", seq_lens)
    check_int("query_start_loc", query_start_loc)
    check_dim("block_table", block_table, 2, "[B, max_blocks]")
    check_dim("seq_lens", seq_lens, 1, "[B]")
    n_seqs = seq_lens.shape[0]
    if block_table.shape[0] < n_seqs or tuple(query_start_loc.shape) != (n_seqs + 1,):
        raise ValueError(
            f"block_table {tuple(block_table.shape)} needs >= B rows and query_start_loc "
            f"{tuple(query_start_loc.shape)} must be [B + 1] for B = {n_seqs}"
        )
    if not query_start_loc.is_cuda:  # value checks read the data: on CUDA they would sync the host
        starts = query_start_loc.tolist()  # and break CUDA-graph capture, so only CPU tensors get them
        if (
            starts[0] != 0
            or starts[-1] != q.shape[0]
            or any(a > b for a, b in zip(starts, starts[1:], strict=False))
        ):
            raise ValueError(f"query_start_loc must rise from 0 to T = {q.shape[0]}, got {starts}")
    _check_scale(scale)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)
    if shared is not None:
        for name in ("order", "members", "tiles", "starts", "count"):
            t = getattr(shared, name)
            n = 1 if name == "count" else n_seqs
            if t.dtype != torch.int32 or tuple(t.shape) != (n,) or t.device != q.device:
                raise ValueError(
                    f"shared {name} must be int32 [{n}] on {q.device} (shared_prefix_groups), got "
                    f"{t.dtype} {tuple(t.shape)} on {t.device}"
                )
    if out is not None:
        shape = _out_shape(q, v_cache)
        if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must be {shape} {q.dtype} on {q.device} ([T, Hq, Dv], q's dtype), got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        check_last_dim_contiguous("out", out)
    if max_query_len is not None and (not isinstance(max_query_len, int) or max_query_len < 1):
        raise ValueError(
            f"max_query_len must be a positive int (a bound on the longest query count) or None, got {max_query_len!r}"
        )
    with torch.no_grad():
        return _PAGED_IMPLS[_backend(q, k_cache, v_cache)](
            q, k_cache, v_cache, block_table, seq_lens, query_start_loc, float(scale), out=out, shared=shared,
            max_query_len=max_query_len,
        )  # fmt: skip
