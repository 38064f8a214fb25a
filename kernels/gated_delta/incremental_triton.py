"""Design C on Triton (the CUDA path of `incremental.py`): the chunk kernels' launcher (`chunk_forward`),
the training op with its autograd, and the cached step that sends a sequence's single row to the decode
step (`incremental_decode_triton.py`) and every other sequence's rows, from the rows its slot holds on,
to the chunk kernels (`incremental_chunk_triton.py`). Both give a row the same bits
(`incremental_tiles_triton.py`).

Backward (`incremental_triton_bwd.py`): the forward's scratch is recomputed, the chunks' gradients are
taken in reverse (fp32), and autograd of the torch rules carries them to q, k, a, b, A_log, dt_bias;
deterministic (DESIGN rule 7).
"""

import torch
import triton

from . import incremental_cache as layout
from . import incremental_tiles_triton as tiles
from .checks import check_gated_delta_inputs, check_slots, check_state
from .incremental_cache import check_decode_only
from .incremental_chunk_triton import normalize_kernel, output_kernel, prepare_kernel, state_kernel
from .incremental_decode_triton import decode_forward
from .incremental_triton_bwd import chunk_backward
from .rules import L2NORM_EPS, SOFTPLUS_THRESHOLD, gates, normalized_qk, qk_scale


def _check_gate_strides(a, b):
    for name, t in (("a", a), ("b", b)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def chunk_forward(q, k, v, a, b, A_log, dt_bias, bos, eos, h0, read, ht, write, out, cache=None, cache_slot=None,
                  held=None, chunks=None) -> dict:  # fmt: skip
    """The chunk kernels over rows [bos[n], eos[n]) of each sequence, whose cache slot cache_slot[n] holds
    held[n] rows of a partial chunk before bos[n] (None: none; an IncrementalCache), from the state
    h0[read[n]] at the chunks' first anchor (0 where read[n] < 0). o goes to out's rows [bos[n], eos[n]);
    the state after the last full chunk (or 0 for read[n] < 0) to ht[write[n]] (write[n] >= 0), with a
    cache also rounded to its state_dt; a partial last chunk's new rows to cache slot cache_slot[n] (-1 or
    no cache: none). chunks: their `layout.ChunkMap` on the device (None: made here, a host read).
    Returns the scratch (q_hat, k_hat, x, g, beta, G, W, U, V', the chunk start states h, T) and the chunk map."""
    n_tokens, hk, d_k = q.shape
    hv, d_v = v.shape[1], v.shape[2]
    n_seqs, device, dt = bos.shape[0], v.device, q.dtype
    chunk, rows = layout.CHUNK, tiles.ROWS
    held = torch.zeros_like(bos) if held is None else held
    chunks = (chunks or layout.chunk_map(bos, eos, held)).to(device)
    n_chunks, n_rows = chunks.seq.shape[0], max(n_tokens, chunks.rows)
    f32 = dict(dtype=torch.float32, device=device)
    s = {name: torch.empty(n_rows, h, d, dtype=dt, device=device)
         for name, h, d in (("q", hk, d_k), ("k", hk, d_k), ("x", hv, d_v), ("w", hv, d_k), ("u", hv, d_v), ("vnew", hv, d_v))}  # fmt: skip
    s.update(g=torch.empty(n_rows, hv, **f32), beta=torch.empty(n_rows, hv, **f32), G=torch.empty(n_rows, hv, **f32))
    s["h"] = torch.empty(max(n_chunks, 1), hv, d_v, d_k, dtype=dt, device=device)
    s["t"] = torch.empty(n_rows, hv, chunk, **f32)
    if cache is None or cache_slot is None:
        cache_slot = torch.full((n_seqs,), -1, dtype=torch.int64, device=device)
        ck = cx = cvn = s["q"]
        cg = cb = ct = s["g"]
        ht_dt = ht
    else:
        ck, cx, cg, cb, ct, cvn = cache.k, cache.x, cache.g, cache.beta, cache.t, cache.vnew
        ht_dt = cache.state_dt
    sk, sx, sg, sb, st, svn = (t.stride(0) for t in (ck, cx, cg, cb, ct, cvn))  # slot strides (vLLM: the page)
    block_k, block_dv, block_v = tiles.block_sizes(d_k, d_v)
    const = dict(DK=d_k, DV=d_v, BLOCK_K=block_k, ROWS=rows, CHUNK=chunk)
    dots = tiles.dot_options(dt)
    bos, eos, held = bos.long().contiguous(), eos.long().contiguous(), held.long().contiguous()
    ratio = hv // hk
    seq, first, src = chunks.seq, chunks.first, chunks.src
    if n_chunks:
        normalize_kernel[(n_chunks * (chunk // rows), hk)](
            q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), s["q"], s["k"], s["x"], s["g"], s["beta"], bos,
            eos, seq, first, src, cache_slot, ck, cx, cg, cb, sk, sx, sg, sb, n_chunks, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0), hk, hv, ratio, qk_scale(d_k),
            L2NORM_EPS, BLOCK_DV=block_dv, SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, **const, **tiles.launch_options(),
        )  # fmt: skip
        prepare_kernel[(n_chunks, hv)](
            s["k"], s["x"], s["g"], s["beta"], s["G"], s["w"], s["u"], s["t"], bos, eos, seq, first, src, cache_slot,
            ck, cx, cg, cb, ct, sk, sx, sg, sb, st, n_chunks, hk, hv, ratio, BLOCK_V=block_v, **dots, **const,
            **tiles.launch_options("prepare"),
        )  # fmt: skip
    if n_seqs:
        state_kernel[(triton.cdiv(d_v, block_v), n_seqs * hv)](
            s["w"], s["u"], s["k"], s["G"], s["vnew"], s["h"], h0, ht, ht_dt, bos, eos, held, first,
            chunks.chunk_start, read, write, cache_slot, cvn, h0.stride(0), ht.stride(0), ht_dt.stride(0), svn, n_seqs,
            hk, hv, ratio, BLOCK_V=block_v, WRITE_DT=ht_dt is not ht, **dots, **const, **tiles.launch_options("state"),
        )  # fmt: skip
    if n_chunks:
        output_kernel[(n_chunks, hv, triton.cdiv(d_v, block_v))](
            s["q"], s["k"], s["G"], s["vnew"], s["h"], out, bos, eos, seq, first, src, n_chunks, out.stride(0),
            out.stride(1), hk, hv, ratio, BLOCK_V=block_v, **dots, **const, **tiles.launch_options("output"),
        )  # fmt: skip
    s.update(seq=seq, first=first, chunk_start=chunks.chunk_start)
    return s


def _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state):
    """(o, states after each sequence's last full chunk, the chunk kernels' scratch)."""
    n_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    ids = torch.arange(n_seqs, device=v.device)
    if initial_state is None:
        final = torch.zeros(n_seqs, v.shape[1], v.shape[2], q.shape[2], dtype=torch.float32, device=v.device)
        h0, read = final, torch.full_like(ids, -1)
    else:
        final, h0, read = initial_state.clone(), initial_state.contiguous(), ids
    o = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    scratch = chunk_forward(q, k, v, a, b, A_log, dt_bias, cu[:-1], cu[1:], h0, read, final, ids, o)
    return o, final, scratch


class _IncrementalFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state):
        o, final, _ = _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
        ctx.save_for_backward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
        return o, final

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state = ctx.saved_tensors
        _, _, scratch = _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
        leaves = [t.detach().requires_grad_() for t in (q, k, a, b, A_log, dt_bias)]
        with torch.enable_grad():
            q_hat, k_hat = normalized_qk(leaves[0], leaves[1])
            g, beta = gates(*leaves[2:])
        if d_final is None:
            d_final = torch.zeros(cu_seqlens.shape[0] - 1, v.shape[1], v.shape[2], q.shape[2], device=v.device)
        cu = cu_seqlens.long()
        dq_hat, dk_hat, dv, dg, dbeta, dh0 = chunk_backward(v, do, d_final.contiguous(), scratch, cu[:-1], cu[1:])
        torch.autograd.backward([q_hat, k_hat, g, beta], [dq_hat, dk_hat, dg, dbeta])
        dq, dk, da, db, d_a_log, d_dt_bias = (t.grad for t in leaves)
        return dq, dk, dv.to(v.dtype), da, db, d_a_log, d_dt_bias, None, (dh0 if initial_state is not None else None)


def incremental_gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state=None):
    """`incremental.incremental_gated_delta_rule` on the Triton kernels."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens)
    _check_gate_strides(a, b)
    if initial_state is not None:
        check_state("initial_state", initial_state, n_seqs, v, k)
    tensors = (q, k, v, a, b, A_log, dt_bias) + (() if initial_state is None else (initial_state,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _IncrementalFunction.apply(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
    o, final, _ = _forward(q, k, v, a, b, A_log, dt_bias, cu_seqlens, initial_state)
    return o, final


def incremental_gated_delta_rule_cached_triton(
    q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens, decode_only=False, split=None
):
    """`incremental.incremental_gated_delta_rule_cached` on the Triton kernels. decode_only (one row a
    sequence): the decode step alone, no host read (CUDA graphs). Otherwise the step's `layout.StepSplit`
    (split; None: made here, one host read): a sequence's single row to the decode step, the other
    sequences' rows to the chunk kernels, which start at the partial chunk their slot holds. Every kernel
    that writes a state writes its rounded copy too."""
    n_seqs = check_gated_delta_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens, padding_rows=True)
    _check_gate_strides(a, b)
    check_slots(slots, has_state, n_seqs, cache.check(k, v), padded=True)
    layout.check_context_lens(context_lens, n_seqs)
    check_decode_only(decode_only, q, cu_seqlens)
    cu = cu_seqlens.long()
    idx = slots.long()
    read = torch.where(has_state, idx, -1)
    o = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    if decode_only:
        decode_forward(q, k, v, a, b, A_log, dt_bias, o, cache, cu[:-1], layout.held_rows(has_state, context_lens),
                       idx, read)  # fmt: skip
        return o
    if split is None:
        split = layout.split_step(cu_seqlens, context_lens, has_state, v.device)
    none = torch.full_like(idx, -1)
    if split.n_single:
        decode_forward(q, k, v, a, b, A_log, dt_bias, o, cache, cu[:-1], split.held, torch.where(split.single, idx, none),
                       read)  # fmt: skip
    if split.chunks.seq.shape[0]:  # the other sequences, from their slots' held rows on (a single has no rows here)
        chunk_forward(q, k, v, a, b, A_log, dt_bias, cu[:-1] + split.single.long(), cu[1:], cache.state,
                      torch.where(split.single, idx, read), cache.state, idx, o, cache=cache, cache_slot=idx,
                      held=split.held, chunks=split.chunks)  # fmt: skip
    return o
