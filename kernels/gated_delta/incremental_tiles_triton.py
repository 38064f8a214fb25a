"""The row-tile arithmetic of design C's Triton kernels (math: `incremental.py`), one @triton.jit routine per
operation, called by the chunk kernels (`incremental_chunk_triton.py`: training, prefill, chunked prefill)
and by the decode step (`incremental_decode_triton.py`).

Invariant: a row's value depends only on the row's operands, never on the rows beside it in a launch.
Rows of a chunk sit at their chunk positions (row i of the chunk at place i % ROWS of its row tile), and
the decode step places its row the same way, with zeros in the tile's other places. Every sum that
rounds is a tl.dot, whose order depends neither on the tile's layout (which the compiler picks per kernel)
nor on its rows and columns: a bf16 product on tensor cores is a chain of k16 MMAs in K order on the fp32
accumulator, each element from its row, column and accumulator alone, so the chunk kernels take a whole
chunk's rows at once ([CHUNK, DK] x [DK, CHUNK] k.k and q.k, [CHUNK, CHUNK] x [CHUNK, DK or BLOCK_V] W, U
and the causal product, [CHUNK, DK] x [DK, BLOCK_V] W S, q S: a 64-row wgmma on the H200) where the decode
step takes a 16-row tile (mma.sync), with the same elements
(tests/kernels/gated_delta/test_dot_rows_cuda.py); the state update is [BLOCK_V, CHUNK] x [CHUNK, DK]
in both. fp32 products are FMA dots, one fmaf chain per element in K order (`fdot`, and every dot of
fp32 inputs): the l2 norms, the gate sums and T's rows before their tile (`tile_rows`: [ROWS, ROWS] x
[ROWS, CHUNK], then [ROWS, CHUNK] x [CHUNK, CHUNK]; as tf32 tensor-core dots such sums differ between the
chunk kernels and the decode step on the H200, as FMA dots they agree). T within a tile, L = (I + A_bb)^-1,
is the one chain that is no dot: row by row, fp32 FMAs in row order, every tile of a chunk at once in the
chunk kernel (`solve_blocks`), the decode step's one row by the same FMAs on the same values
(`solve_block_row_at`, its operands read from memory), so T's rows are solved a row tile after another
(the prepare kernel passes the tiles' rows through memory, `incremental_chunk_triton.py`). The rows past
a row enter it only as exact zeros (masked A and P, L's and T's zero columns past the row), so the decode
step gets the chunk kernels' bits. The only other sums pick
one value out of a tile (a masked sum with one nonzero term: exact in any order). The kernels launch
without FP contraction (no compiler choice may fuse a multiply-add in one kernel and not in the other);
every dot names its accumulator, so no pass may fold an addition into a dot in one kernel and not in
the other.
`benchmarks/inspect_gated_delta.py` compiles the kernels for sm_90a and checks that each shared dot
gets the same shape and MMA instruction in every kernel.
"""

import triton
import triton.language as tl
from triton.language.standard import _sum_combine

# Rows of a chunk per row tile: T's rows are solved a tile after another (L within a tile by substitution,
# `solve_blocks`), and the decode step's products take its row in a tile of ROWS (tl.dot needs >= 16 on the
# GPU); the chunk kernels' other products take the whole chunk. ROWS = CHUNK would solve T as one 64-row
# substitution (the H200 benchmark decides, `benchmarks/bench_gated_delta.py --rows`; the CUDA decode step
# is written for 16).
ROWS = 16
# v columns per program (the N of the state products): one value for every kernel, so every dot over
# the state has one shape.
BLOCK_V = 64
# Warps of the kernels that call these routines. No element depends on them (a dot's elements are those
# of any other layout: tests/kernels/gated_delta/test_dot_rows_cuda.py at 4 and 8 warps; solve_blocks'
# FMAs are explicit), so each kernel takes its fastest: WARPS, or KERNEL_WARPS[name] where set. Measured
# on the H200 (16 k / 32 v heads of 128, bf16; ms at 1 x 8192 / 16 x 1024 tokens): prepare 0.92 / 1.83
# at 8 warps, 0.72 / 1.45 at 4; output 0.37 / 0.73 at 8, 0.21 / 0.40 at 4; the state kernel 0.53 / 0.58
# at 8, 0.78 / 0.53 at 4 (it stays at 8).
WARPS = 8
KERNEL_WARPS = {"prepare": 4, "output": 4}
# The decode step's kernels' own warps and register cap (None: WARPS, no cap). They decide only how many programs share an SM: uncapped, the decode
# kernels take 170 and 149 registers a thread (one program an SM at 8 warps); at 128, two. Measured on the
# H200 (`bench_gated_delta.py --step-maxnreg`, 32 value heads): the step at 256 sequences 24% faster, its
# bits the training forward's (the CUDA tests run with it).
STEP_WARPS: int | None = None
STEP_MAXNREG: int | None = 128


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + a @ b (fp32 accumulation). DOT_FP32, interpreter only: its tl.dot reads bf16 operands as raw
    bits, so there the products are summed over the last axis of a broadcast fp32 product."""
    if DOT_FP32:
        prod = a.to(tl.float32)[:, None, :] * tl.trans(b.to(tl.float32))[None, :, :]
        out = acc + tl.reduce(prod, 2, _sum_combine)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def fdot(a, b, acc):
    """acc + a @ b of fp32 tiles by fp32 FMAs: each element's products added in K order, whatever the layout."""
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def first_column(tile):
    """Column 0 of tile [M, N], fp32 [M] (exact, as `pick`)."""
    return tl.reduce(tl.where((tl.arange(0, tile.shape[1]) == 0)[None, :], tile, 0.0), 1, _sum_combine)


@triton.jit
def computed(rows, valid):
    """rows [M, N] as a value computed in registers (rows not valid 0): the chunk kernels pass the loaded
    first operands of their products through it, so that a product reads it from registers as the decode
    step's products read their computed rows (an operand's source changes no element: the invariant)."""
    return tl.where(valid[:, None], rows, 0.0).to(rows.dtype)


@triton.jit
def pick(tile, at):
    """The row of tile [M, N] where at [M] is True (a masked sum with one nonzero term: exact), fp32 [N]."""
    return tl.reduce(tl.where(at[:, None], tile.to(tl.float32), 0.0), 0, _sum_combine)


@triton.jit
def pick_along(tile, at, AXIS: tl.constexpr):
    """tile (fp32) summed along AXIS where at (broadcast to tile) is True, one True along AXIS (exact, as `pick`)."""
    return tl.reduce(tl.where(at, tile, 0.0), AXIS, _sum_combine)


@triton.jit
def pick_one(vec, at):
    """vec [N] where at [N] is True, fp32 (exact, as `pick`)."""
    return tl.reduce(tl.where(at, vec.to(tl.float32), 0.0), 0, _sum_combine)


@triton.jit
def pick_entries(vec, at):
    """vec [N] at the places at [M, N] marks, one per row: fp32 [M] (exact, as `pick`)."""
    return tl.reduce(tl.where(at, vec[None, :], 0.0), 1, _sum_combine)


@triton.jit
def normalized_rows(X, rows, valid, head, stride_t, stride_h, ok, eps, scale, D: tl.constexpr):
    """l2(x) * scale of a row tile [ROWS, BK] of X[rows, head] (fp32; rows not valid are 0)."""
    mask = valid[:, None] & (ok < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_t + head * stride_h + ok[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    ones = tl.full([x.shape[1], 16], 1.0, tl.float32)
    squares = fdot(x * x, ones, tl.full([x.shape[0], 16], 0.0, tl.float32))  # [ROWS, 16], equal columns
    return x * tl.rsqrt(first_column(squares) + eps)[:, None] * scale


@triton.jit
def gate_rows(A, B, rows, valid, hv, stride_at, stride_bt, decay, dt_bias, SOFTPLUS_MAX: tl.constexpr):
    """(g, beta) fp32 [ROWS] of v head hv at `rows` (rules.py; 0 where not valid)."""
    x = tl.load(A + rows * stride_at + hv, mask=valid, other=0.0).to(tl.float32) + dt_bias
    soft = tl.where(x > SOFTPLUS_MAX, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_MAX))))
    b = tl.load(B + rows * stride_bt + hv, mask=valid, other=0.0).to(tl.float32)
    beta = tl.math.div_rn(1.0, 1.0 + tl.exp(-b)).to(B.dtype.element_ty).to(tl.float32)
    return tl.where(valid, -decay * soft, 0.0), tl.where(valid, beta, 0.0)


@triton.jit
def gate_cumsum(g, rc):
    """G [C]: G_i = g_0 + g_1 + ... + g_i, added in that order (an FMA dot with a lower-triangular mask
    of ones; g [C], rc = arange(C))."""
    lower = tl.where(rc[None, :] <= rc[:, None], 1.0, 0.0)
    g16 = tl.broadcast_to(g[:, None], [g.shape[0], 16])
    return first_column(fdot(lower, g16, tl.full([g.shape[0], 16], 0.0, tl.float32)))


@triton.jit
def decayed_keys(k_c, beta_c, G_c, dt: tl.constexpr):
    """y [C, BK] = dt(beta_j exp(G_j) k_j), the right operand of W = T y."""
    return (k_c.to(tl.float32) * (beta_c * tl.exp(G_c))[:, None]).to(dt)


@triton.jit
def a_rows(k_r, k_c, beta_r, G_r, G_c, pos, cols, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """A [ROWS, N] of the row tile at chunk positions pos against the N rows of k_c at positions cols:
    beta_i (k_i . k_j) exp(G_i - G_j) for j < i, else 0."""
    kk = dot(k_r, tl.trans(k_c), tl.full([k_r.shape[0], k_c.shape[0]], 0.0, tl.float32), PRECISION, DOT_FP32)
    before = cols[None, :] < pos[:, None]
    return tl.where(before, beta_r[:, None] * kk * tl.exp(tl.where(before, G_r[:, None] - G_c[None, :], 0.0)), 0.0)


@triton.jit
def solve_blocks(a3, rr):
    """T within each row tile, every tile at once: a3 [NB, ROWS, ROWS] holds A within tile b (A_ij of its
    rows i, j); returns L_b = (I + A_bb)^-1 [NB, ROWS, ROWS] by forward substitution in row order: row i
    is e_i minus A_ij L_j over j < i, each added by an fp32 FMA in j order, then 0 past column i. Outer
    products: once row j is solved, every row takes its term, so each row's chain is the same FMAs on the
    same values in the same order, whatever the layout (`solve_block_row_at`'s for one row)."""
    eye = rr[:, None] == rr[None, :]
    acc = tl.where(eye[None, :, :], 1.0, tl.full(a3.shape, 0.0, tl.float32))
    t = tl.full(a3.shape, 0.0, tl.float32)
    for j in range(a3.shape[1]):
        own = (rr == j)[None, :, None]
        row = tl.where((rr <= j)[None, :], pick_along(acc, own, 1), 0.0)  # [NB, ROWS]: row j of every tile
        t = tl.where(own, row[:, None, :], t)
        acc = tl.fma(-pick_along(a3, (rr == j)[None, None, :], 2)[:, :, None], row[:, None, :], acc)
    return t


@triton.jit
def solve_block_row_at(a_row, l_rows, l_stride, place, rr):
    """Row `place` of a row tile's L (`solve_blocks`' chain) with its operands in memory, for the decode
    step: a_row[j] the row's A within the tile, l_rows + j * l_stride + rr the tile's row j of L (the
    slot's row of T in the tile's columns).
    The same FMAs on the same values, unrolled (every load issued ahead of the chain), with no reduction
    and no barrier: the rows from `place` on are skipped, not added as zeros."""
    acc = tl.where(rr == place, 1.0, 0.0)
    for j in tl.static_range(rr.shape[0]):
        live = j < place
        a_j = tl.load(a_row + j, mask=live, other=0.0)
        l_j = tl.load(l_rows + j * l_stride + rr, mask=(rr * 0 + j) < place, other=0.0)
        acc = tl.where(live, tl.fma(-a_j, l_j, acc), acc)
    return tl.where(rr <= place, acc, 0.0)


@triton.jit
def diagonal_blocks(tile, ROWS: tl.constexpr):
    """The ROWS x ROWS blocks on the diagonal of tile [C, C] (fp32), [C // ROWS, ROWS, ROWS] (exact)."""
    nb: tl.constexpr = tile.shape[0] // ROWS
    cut = tl.reshape(tile, [nb, ROWS, nb, ROWS])
    ib = tl.arange(0, nb)
    return pick_along(cut, (ib[:, None, None, None] == ib[None, None, :, None]), 2)


@triton.jit
def tile_rows(l_t, a_off, t_before, first, rc, ROWS: tl.constexpr):
    """The row tile's rows of T [ROWS, C] (first: the tile's first chunk position): T_bb = L (`solve_blocks`,
    l_t [ROWS, ROWS]) in the tile's own columns; before them -L (A_off T_before), A_off [ROWS, C] the
    tile's A at the columns before it (0 from first on), T_before the rows of T before the tile (0 from
    first on): two fp32 FMA dots, the first over the tile's rows, the second over the rows before it;
    0 past the tile's columns. A row reads the tile's other rows only through L's zeros past its own."""
    r = fdot(l_t, a_off, tl.full(a_off.shape, 0.0, tl.float32))
    off = fdot(-r, t_before, tl.full(a_off.shape, 0.0, tl.float32))
    c: tl.constexpr = a_off.shape[1]
    placed = tl.reshape(tl.broadcast_to(l_t[:, None, :], [ROWS, c // ROWS, ROWS]), [ROWS, c])
    own = (rc >= first) & (rc < first + ROWS)
    return tl.where((rc < first)[None, :], off, tl.where(own[None, :], placed, 0.0))


@triton.jit
def solved_product(t_r, z_c, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """dt(T_r z) [ROWS, N]: U (z = x) or W (z = y) of the row tile's T rows t_r [ROWS, C] fp32."""
    acc = tl.full([t_r.shape[0], z_c.shape[1]], 0.0, tl.float32)
    return dot(t_r.to(z_c.dtype), z_c, acc, PRECISION, DOT_FP32).to(z_c.dtype)


@triton.jit
def delta_rows(u, w, s, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """V' = dt(U - W S) [ROWS, BV]: u [ROWS, BV], w [ROWS, BK] (dt), s [BV, BK] fp32 (S^T)."""
    ws = dot(w, tl.trans(s.to(w.dtype)), tl.full([w.shape[0], s.shape[0]], 0.0, tl.float32), PRECISION, DOT_FP32)
    return (u.to(tl.float32) - ws).to(w.dtype)


@triton.jit
def output_weights(q_r, G_r, pos, k_c, G_c, rc, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """The row tile's output weights, both dt: P [ROWS, C] = dt((q_i . k_j) exp(G_i - G_j)) for j <= i
    (else 0) and dt(q_i exp(G_i)) [ROWS, BK]; `output_product` takes them."""
    qk = dot(q_r, tl.trans(k_c), tl.full([q_r.shape[0], k_c.shape[0]], 0.0, tl.float32), PRECISION, DOT_FP32)
    causal = rc[None, :] <= pos[:, None]
    p = tl.where(causal, qk * tl.exp(tl.where(causal, G_r[:, None] - G_c[None, :], 0.0)), 0.0)
    return p.to(q_r.dtype), (q_r.to(tl.float32) * tl.exp(G_r)[:, None]).to(q_r.dtype)


@triton.jit
def output_product(p, qg, vn_c, h_t, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """o fp32 [ROWS, BV] = dt(q_i exp(G_i)) S + sum_{j <= i} dt((q_i . k_j) exp(G_i - G_j)) V'_j from
    `output_weights`' (p, qg); h_t = dt(S) [BK, BV]."""
    o = dot(qg, h_t, tl.full([qg.shape[0], h_t.shape[1]], 0.0, tl.float32), PRECISION, DOT_FP32)
    return dot(p.to(vn_c.dtype), vn_c, o, PRECISION, DOT_FP32)


@triton.jit
def state_after(s, k_c, G_c, vn_c, rc, CHUNK: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """S^T [BV, BK] after a full chunk: exp(G_last) S + sum_j V'_j dt(exp(G_last - G_j) k_j)^T."""
    g_last = pick_one(G_c, rc == CHUNK - 1)
    decayed = (k_c.to(tl.float32) * tl.exp(g_last - G_c)[:, None]).to(k_c.dtype)
    return dot(tl.trans(vn_c), decayed, s * tl.exp(g_last), PRECISION, DOT_FP32)


@triton.jit
def row_place(p, start, rc, rr, ROWS: tl.constexpr):
    """Row p of a chunk (packed row start) in its row tile: (pos, the tile's chunk positions; own, the
    row's place; rows_r, its packed row there and 0 elsewhere; at = rc == p; old = rc < p)."""
    pos = (p // ROWS) * ROWS + rr
    own = pos == p
    return pos, own, tl.where(own, start, 0), rc == p, rc < p


@triton.jit
def state_cells(STATE, hv, iv, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """A program's v tile iv of v head hv's state: (the head's state base, the tile's cells [BLOCK_V,
    BLOCK_K] as int32 offsets from it, their mask, ok, ov, mk, mv)."""
    ok = tl.arange(0, BLOCK_K)
    ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
    mk, mv = ok < DK, ov < DV
    return STATE + hv * DV * DK, ov[:, None] * DK + ok[None, :], mv[:, None] & mk[None, :], ok, ov, mk, mv


@triton.jit
def rounded(x, dt: tl.constexpr):
    """fp32 x rounded to dt to nearest even, as `refresh_state_dt` (torch) rounds: in integer steps for bf16
    (the GPU's cvt.rn bits for every finite value and infinity; the interpreter would truncate a cast)."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dt)


@triton.jit
def state_tile(STATE, read, S_STATE, tile, live, ok):
    """The fp32 state tile of slot `read` (zeros where read < 0: a sequence that starts here)."""
    return tl.load(STATE + read * S_STATE + tile, mask=live & ((ok * 0 + read)[None, :] >= 0), other=0.0)


def launch_options(kernel: str | None = None, step: bool = False) -> dict:
    """The compile options every design-C kernel launches with (module docstring): `kernel`'s warps
    (KERNEL_WARPS, else WARPS); `step`: the decode step's kernels', with STEP_WARPS and STEP_MAXNREG where set."""
    warps = STEP_WARPS if step and STEP_WARPS else KERNEL_WARPS.get(kernel, WARPS)
    options = dict(num_warps=warps, enable_fp_fusion=False)
    if step and STEP_MAXNREG:
        options["maxnreg"] = STEP_MAXNREG
    return options


def is_interpreted() -> bool:
    return type(dot).__name__ == "InterpretedFunction"


def dot_options(dtype) -> dict:
    """PRECISION and DOT_FP32 of a launch for inputs of `dtype`."""
    import torch

    return dict(
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        DOT_FP32=is_interpreted() and dtype != torch.float32,
    )


def block_sizes(d_k: int, d_v: int) -> tuple[int, int, int]:
    """(BK, BDV, BV): the power-of-two tiles of the key and value dims, and the v tile of a program."""
    block_k, block_dv = triton.next_power_of_2(d_k), triton.next_power_of_2(d_v)
    return block_k, block_dv, min(BLOCK_V, block_dv)
