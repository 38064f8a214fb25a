"""Torch path (CPU) of design C: the chunk computation and the incremental step share the row functions
below, so a row's arithmetic is one function of its chunk's earlier rows (math: `incremental.py`).

Every product is `dot`: each element one `reduction.row_sum` over the contraction, whose order depends on
the contraction's length alone (CHUNK or the head dim), so a row's bits do not depend on how many rows
share the call. Zero rows past a row's position meet it only through exact zeros (masked A, T, P).
Tiles are [B, HV, C, ...] (B chunks, or the step's sequences; C = CHUNK rows, zeros past the filled
ones); dt is the input dtype, the operands of the products are rounded to it.
"""

import torch

from ..reduction import row_sum
from . import incremental_cache as layout
from .rules import gates, normalized_qk

# Most elements one broadcast product of `dot` materialises (CPU memory), split along its rows.
DOT_ELEMENTS = 1 << 24


def _sum(t: torch.Tensor) -> torch.Tensor:
    """row_sum over a contiguous last dim (a broadcast product may come out in another layout, whose
    sum would take another path)."""
    return row_sum(t.contiguous())


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] -> fp32 [..., M, N], each element a row_sum over K of fp32 products."""
    a, bt = a.float(), b.float().transpose(-1, -2)  # [..., M, K], [..., N, K]
    batch = max(1, torch.broadcast_shapes(a.shape[:-2], bt.shape[:-2]).numel())
    step = max(1, DOT_ELEMENTS // max(1, batch * bt.shape[-2] * a.shape[-1]))
    parts = [_sum(a[..., m : m + step, None, :] * bt[..., None, :, :]) for m in range(0, a.shape[-2], step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, -2)


def gate_cumsum(g: torch.Tensor) -> torch.Tensor:
    """G [..., C]: G_i = sum_{j <= i} g_j, one row_sum over the chunk's C gate slots (zeros past i)."""
    cols = torch.arange(g.shape[-1], device=g.device)
    return _sum(torch.where(cols[None, :] <= cols[:, None], g[..., None, :], 0.0))


def solve_row(k, x, g, beta, t, G, p):
    """(row p of T fp32 [B, HV, C], of U and W in dt [B, HV, DV], [B, HV, DK]) of tiles whose rows <= p
    hold k, x, g, beta and whose T rows < p are solved (zeros from row p on); p: int64 [B].

    A_pj = beta_p (k_p . k_j) exp(G_p - G_j) (j < p);  T_p = e_p - sum_{l < p} A_pl T_l  (forward
    substitution in row order);  U_p = T_p x,  W_p = T_p y,  y_j = beta_j exp(G_j) k_j."""
    cols = torch.arange(g.shape[-1], device=g.device)
    at = (cols[None, :] == p[:, None])[:, None, :]  # [B, 1, C]
    k_p = torch.gather(k, 2, p[:, None, None, None].expand(-1, k.shape[1], 1, k.shape[3]))  # [B, HV, 1, DK]
    G_p = torch.gather(G, 2, p[:, None, None].expand(-1, G.shape[1], 1))  # [B, HV, 1]
    beta_p = torch.gather(beta, 2, p[:, None, None].expand(-1, beta.shape[1], 1))
    before = (cols[None, :] < p[:, None])[:, None, :]  # [B, 1, C]
    kk = dot(k_p, k.transpose(-1, -2))[:, :, 0]  # [B, HV, C]
    a_row = torch.where(before, beta_p * kk * torch.exp(torch.where(before, G_p - G, 0.0)), 0.0)
    solved = _sum(a_row[:, :, None, :] * t.transpose(-1, -2))  # [B, HV, C]: sum_l A_pl T_lc
    t_row = torch.where(cols[None, None, :] <= p[:, None, None], torch.where(at, 1.0, 0.0) - solved, 0.0)
    dt = k.dtype
    y = (k.float() * (beta * torch.exp(G))[..., None]).to(dt)  # [B, HV, C, DK]
    u = dot(t_row.to(dt)[:, :, None, :], x)[:, :, 0].to(dt)
    w = dot(t_row.to(dt)[:, :, None, :], y)[:, :, 0].to(dt)
    return t_row, u, w


def delta_rows(u, w, s):
    """V' = U - W S rounded to dt: u [.., M, DV], w [.., M, DK] (dt), s [.., DV, DK] fp32 (S^T)."""
    return (u.float() - dot(w, s.to(w.dtype).transpose(-1, -2))).to(w.dtype)


def output_rows(q, G_rows, rows, k, G, vnew, s):
    """o fp32 [.., M, DV] of rows at chunk positions `rows` [.., M]: q [.., M, DK] (normalised, dt),
    G_rows [.., M]; k [.., C, DK], G [.., C], vnew [.., C, DV] the chunk's tiles; s [.., DV, DK] fp32.
    o_i = exp(G_i) q_i S + sum_{j <= i} (q_i . k_j) exp(G_i - G_j) V'_j."""
    dt = q.dtype
    cols = torch.arange(G.shape[-1], device=G.device)
    causal = cols <= rows[..., None]  # [.., M, C]
    decay = torch.exp(torch.where(causal, G_rows[..., None] - G[..., None, :], 0.0))
    p = torch.where(causal, dot(q, k.transpose(-1, -2)) * decay, 0.0)
    qg = (q.float() * torch.exp(G_rows)[..., None]).to(dt)
    return dot(qg, s.to(dt).transpose(-1, -2)) + dot(p.to(dt), vnew)


def state_after(k, G, vnew, s):
    """The state after a full chunk: exp(G_last) S + sum_j exp(G_last - G_j) k_j V'_j^T, as S^T [.., DV, DK]."""
    g_last = G[..., -1]
    decayed = (k.float() * torch.exp(g_last[..., None] - G)[..., None]).to(k.dtype)  # [.., C, DK]
    return s * torch.exp(g_last)[..., None, None] + dot(vnew.transpose(-1, -2), decayed)


def row_inputs(q, k, v, a, b, A_log, dt_bias):
    """Per token: q_hat, k_hat [T, HK, DK] rounded to the input dtype; x = beta v [T, HV, DV] rounded;
    g, beta fp32 [T, HV] (rules.py)."""
    q_hat, k_hat = normalized_qk(q, k)
    g, beta = gates(a, b, A_log, dt_bias)
    x = (v.float() * beta[..., None]).to(v.dtype)
    return q_hat.to(q.dtype), k_hat.to(q.dtype), x, g, beta


def chunk_forward(q, k, v, a, b, A_log, dt_bias, starts, ends, h0):
    """The chunk computation over rows [starts[n], ends[n]) of each sequence, from the boundary states
    h0 [N, HV, DV, DK] fp32 at starts[n]. Returns (o [T, HV, DV] in v's dtype (rows outside the ranges
    0), states after each sequence's last full chunk [N, HV, DV, DK], the tail partial chunks' tiles
    (k, x, g, beta, t, vnew: [N, HV, C, ..]) and their row counts [N])."""
    C = layout.CHUNK
    n_seqs, hv = starts.shape[0], v.shape[1]
    heads = torch.arange(hv, device=v.device) // (hv // q.shape[1])
    q_hat, k_hat, x, g, beta = row_inputs(q, k, v, a, b, A_log, dt_bias)
    lengths = (ends - starts).long()
    counts = (lengths + C - 1) // C  # [N] chunks
    seq = torch.repeat_interleave(torch.arange(n_seqs, device=v.device), counts)
    first = torch.cumsum(counts, 0) - counts  # [N]: each sequence's first chunk
    idx = starts.long()[seq, None] + (torch.arange(seq.shape[0], device=v.device) - first[seq])[:, None] * C
    idx = idx + torch.arange(C, device=v.device)  # [NC, C]
    valid = idx < ends.long()[seq, None]
    idx = idx.clamp(max=max(q.shape[0] - 1, 0))

    def tile(rows, per_head):  # [T, H, ..] -> [NC, HV, C, ..], zeros past the sequence
        t = rows[idx][:, :, heads] if per_head else rows[idx]
        t = torch.where(valid.view(*valid.shape, *[1] * (t.dim() - 2)), t, torch.zeros_like(t))
        return t.transpose(1, 2)

    qt, kt, xt, gt, bt = tile(q_hat, True), tile(k_hat, True), tile(x, False), tile(g, False), tile(beta, False)
    G = gate_cumsum(gt)
    t = torch.zeros(*gt.shape, C, device=v.device)
    us, ws = [], []
    for i in range(C):  # forward substitution, row by row, every chunk at once
        t_row, u, w = solve_row(kt, xt, gt, bt, t, G, torch.full_like(seq, i))
        t = torch.where((torch.arange(C, device=v.device) == i)[:, None], t_row[:, :, None, :], t)
        us.append(u)
        ws.append(w)
    U, W = torch.stack(us, 2), torch.stack(ws, 2)  # [NC, HV, C, DV / DK]
    state = h0
    o = torch.zeros(q.shape[0], hv, v.shape[2], device=v.device)
    vnew = torch.zeros_like(U)
    for c in range(int(counts.max()) if n_seqs else 0):  # chunks in order, every sequence at once
        live = torch.nonzero(counts > c)[:, 0]
        j = first[live] + c
        s = state[live]
        vn = delta_rows(U[j], W[j], s)
        vnew = vnew.index_put((j,), vn)
        rows = torch.arange(C, device=v.device).expand(*G[j].shape)
        out = output_rows(qt[j], G[j], rows, kt[j], G[j], vn, s)  # [L, HV, C, DV]
        keep = valid[j]
        o = o.index_put((idx[j][keep],), out.transpose(1, 2)[keep])
        full = keep.all(1)[:, None, None, None]
        state = state.index_put((live,), torch.where(full, state_after(kt[j], G[j], vn, s), s))
    last = first + counts - 1
    tail = (lengths % C).to(torch.int32)
    tails = tuple(z[last.clamp(min=0)] for z in (kt, xt, gt, bt, t, vnew))
    return o.to(v.dtype), state, tails, tail


def step_row(q, k, v, a, b, A_log, dt_bias, rows, cache, slots, p, fresh):
    """o [B, HV, DV] in v's dtype of one row per sequence (packed rows `rows` [B], at chunk positions
    p [B]) from its slot of the cache (IncrementalCache), which gets the row; fresh [B]: the sequence
    starts here (state 0, written to the slot). A row at position CHUNK - 1 commits the chunk's state."""
    C = layout.CHUNK
    hv = v.shape[1]
    heads = torch.arange(hv, device=v.device) // (hv // q.shape[1])
    q_hat, k_hat, x, g, beta = row_inputs(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias)
    idx = slots.long()
    cols = torch.arange(C, device=v.device)
    old_rows, new_row = cols[None, :] < p[:, None], cols[None, :] == p[:, None]  # [B, C]

    def tile(cached, new, per_head=False):  # cache rows < p, then the new row, then zeros: [B, HV, C, ..]
        old = torch.cat([cached[idx], torch.zeros_like(cached[idx][:, :1])], 1)  # [B, C, H, ..]
        if per_head:
            old, new = old[:, :, heads], new[:, heads]
        shape = (*new_row.shape, *[1] * (old.dim() - 2))
        t = torch.where(new_row.view(shape), new[:, None], torch.where(old_rows.view(shape), old, 0))
        return t.transpose(1, 2)

    kt, xt, gt, bt = tile(cache.k, k_hat, True), tile(cache.x, x), tile(cache.g, g), tile(cache.beta, beta)
    tt = tile(cache.t, torch.zeros_like(cache.t[idx][:, 0]))  # rows < p solved, zeros from row p on
    s = torch.where(fresh[:, None, None, None], 0.0, cache.state[idx])
    G = gate_cumsum(gt)
    t_row, u, w = solve_row(kt, xt, gt, bt, tt, G, p)
    vn = delta_rows(u[:, :, None], w[:, :, None], s)  # [B, HV, 1, DV]
    vnt = tile(cache.vnew, vn[:, :, 0])
    G_p = torch.gather(G, 2, p[:, None, None].expand(-1, hv, 1))  # [B, HV, 1]
    o = output_rows(q_hat[:, heads][:, :, None], G_p, p[:, None, None].expand(-1, hv, 1), kt, G, vnt, s)
    full = p == C - 1
    if bool(full.any()):
        s = torch.where(full[:, None, None, None], state_after(kt, G, vnt, s), s)
    write = full | fresh
    cache.state[idx[write]] = s[write]
    keep = ~full
    at = (idx[keep], p[keep])
    for name, value in (("k", k_hat), ("x", x), ("g", g), ("beta", beta), ("t", t_row), ("vnew", vn[:, :, 0])):
        getattr(cache, name).index_put_(at, value[keep])
    return o[:, :, 0].to(v.dtype)


def write_tails(cache, slots, tails, tail, ratio):
    """Rows 0 .. tail[n] - 1 of each sequence's tail tiles (k, x, g, beta, t, vnew: [N, HV, C, ..]) to
    its slot of the cache."""
    k, x, g, beta, t, vnew = tails
    for n, (slot, rows) in enumerate(zip(slots.tolist(), tail.tolist())):
        cache.k[slot, :rows] = k[n, ::ratio, :rows].transpose(0, 1)
        for name, value in (("x", x), ("g", g), ("beta", beta), ("t", t), ("vnew", vnew)):
            getattr(cache, name)[slot, :rows] = value[n, :, :rows].transpose(0, 1)


def _to_boundary(cu_seqlens: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The rows of each sequence's step that `cached_torch` takes one at a time (int64 [N]): those that
    complete its partial chunk (held > 0), or its single row (a decode at a chunk boundary); the rest start
    on a chunk boundary and go to `chunk_forward`."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    to_boundary = torch.clamp(layout.CHUNK - held.long(), max=layout.CHUNK) % layout.CHUNK  # 0 at a boundary
    head = torch.minimum(lengths, to_boundary)
    return torch.where((held == 0) & (lengths == 1), lengths, head)


def cached_torch(q, k, v, a, b, A_log, dt_bias, cu_seqlens, cache, slots, has_state, context_lens):
    """`incremental.incremental_gated_delta_rule_cached` on the torch path: the rows that complete a
    partial chunk (or a decode at a boundary) one at a time (`step_row`), the rest by `chunk_forward`
    from the slot's boundary state; then the rounded states it wrote (`refresh_state_dt`)."""
    idx = slots.long()
    cu = cu_seqlens.long()
    held = layout.held_rows(has_state, context_lens)
    head = _to_boundary(cu, held)  # 0 for a sequence with no rows (slot -1 allowed): never touched
    o = torch.zeros(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
    for r in range(int(head.max()) if head.numel() else 0):
        live = torch.nonzero(head > r)[:, 0]
        rows = cu[live] + r
        fresh = ~has_state[live] & (r == 0)
        o[rows] = step_row(q, k, v, a, b, A_log, dt_bias, rows, cache, slots[live], held[live] + r, fresh)
    starts = cu[:-1] + head
    rest = torch.nonzero(cu[1:] > starts)[:, 0]
    if rest.numel():
        read = (has_state | (head > 0))[rest]
        h0 = torch.where(read[:, None, None, None], cache.state[idx[rest]], 0.0)
        out, state, tails, tail = chunk_forward(q, k, v, a, b, A_log, dt_bias, starts[rest], cu[1:][rest], h0)
        rows = torch.cat([torch.arange(int(starts[n]), int(cu[n + 1])) for n in rest.tolist()]).to(v.device)
        o[rows] = out[rows]
        cache.state[idx[rest]] = state
        write_tails(cache, idx[rest], tails, tail, v.shape[1] // q.shape[1])
    layout.refresh_state_dt(cache, idx, has_state, held, cu)
    return o
