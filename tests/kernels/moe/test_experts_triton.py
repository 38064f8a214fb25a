"""Triton fused MoE (`kernels/moe/experts_triton.py`, `experts_triton_bwd.py`): the kernels' logic on CPU through the
Triton interpreter (small odd shapes, 16x16x16 tiles so a problem spans several tiles, K steps and
padded expert runs), and the compiled kernels on CUDA at Qwen3-30B-A3B's expert shapes.

The forward is checked bitwise against the composition of the Triton dense ops expert by expert
(`linear_triton.linear_triton`, `activation_triton.silu_and_mul_triton`, then torch's slot-order combine),
with the same BLOCK_K. Interpreter caveat: Triton's interpreter casts fp32 -> bf16 by truncation
(`cast_impl` passes no rounding mode), the GPU rounds to nearest even; the dense ops and the fused
kernel both cast in the interpreter, and the reference's last rounding (done by torch) is made to
truncate too (`_round_like_interpreter`, whose premise `test_interpreter_casts_bf16_by_truncation`
checks). Invariance is always torch.equal; the backward is compared with the torch path."""

import importlib
import sys
import types

import numpy as np
import pytest
import torch

from vexact_vllm.kernels import dispatch, fused_moe, reference_mode
from vexact_vllm.kernels.capture import gc_paused
from vexact_vllm.kernels.moe import experts

pytest.importorskip("triton")

MODULES = (
    "vexact_vllm.kernels.moe.experts_triton", "vexact_vllm.kernels.moe.experts_triton_bwd",
    "vexact_vllm.kernels.moe.align_triton", "vexact_vllm.kernels.moe.core_triton",
    "vexact_vllm.kernels.gemm.linear_triton",  # its gemm_config, and gemm/tiles_triton's tile order, run in the MoE kernels
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (T, H, E, I, k): H and I not multiples of the 16-wide tiles (K tails, N tails), T odd
SHAPES = [(5, 40, 4, 24, 1), (17, 40, 6, 24, 2), (33, 24, 8, 20, 3), (17, 50, 5, 12, 2)]


@pytest.fixture(scope="module")
def mt(interpreted_modules):
    """experts_triton, experts_triton_bwd, align_triton, core_triton (and gemm/linear_triton, whose tile order
    the MoE kernels call) imported afresh with TRITON_INTERPRET=1 (they take CPU tensors), as a
    namespace (fwd, bwd, align, core); later imports get the compiled kernels (linear_triton is imported
    compiled first, so that the compiled module comes back after)."""
    importlib.import_module("vexact_vllm.kernels.gemm.linear_triton")
    fwd, bwd, align, core, _ = interpreted_modules(MODULES)
    mods = types.SimpleNamespace(fwd=fwd, bwd=bwd, align=align, core=core)
    try:  # Triton 3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.5 refuses
        fwd.fused_moe_triton(*_inputs(1, 16, 2, 8, 1))
    except Exception as e:
        if "0-dimensional arrays" in str(e):
            pytest.skip(f"Triton's interpreter fails with numpy {np.__version__}: {e}")
        raise
    return mods


@pytest.fixture(scope="module")
def dense(import_interpreted):
    """The interpreted dense ops: (gemm/linear_triton, gemm/activation_triton)."""
    return (
        import_interpreted("vexact_vllm.kernels.gemm.linear_triton"),
        import_interpreted("vexact_vllm.kernels.gemm.activation_triton"),
    )


def _tile(mt, block_m=16, block_n=16):
    return mt.fwd.MoeConfig(block_m, block_n, 16, 2, 4, 2)


@pytest.fixture
def small(mt, dense, monkeypatch):
    """16x16x16 tiles everywhere: the fused kernels, their backward and the dense reference."""
    gemm, _ = dense
    monkeypatch.setattr(mt.fwd, "forward_configs", lambda *_: (_tile(mt), _tile(mt)))
    monkeypatch.setattr(mt.bwd, "backward_configs", lambda dtype, bm: (_tile(mt, bm), _tile(mt, bm)))
    monkeypatch.setattr(gemm, "gemm_config", lambda *_: gemm.GemmConfig(16, 16, 16, 2, 4, 2))
    return mt


def _inputs(n_tokens, hidden, n_experts, inter, top_k, dtype=torch.float32, device="cpu"):
    x = torch.randn(n_tokens, hidden, device=device).to(dtype)
    w_gate_up = (torch.randn(n_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w_down = (torch.randn(n_experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    ids = torch.rand(n_tokens, n_experts, device=device).argsort(-1)[:, :top_k].contiguous()
    weights = torch.softmax(torch.randn(n_tokens, top_k, device=device), -1)
    return x, w_gate_up, w_down, ids, weights


def _round_like_interpreter(t32, dtype):
    """fp32 -> dtype as the Triton interpreter casts: truncation (see the module docstring)."""
    if dtype == torch.float32:
        return t32
    return (t32.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)


def _dense_expert_rows(linear_fn, silu_fn, x, w_gate_up, w_down, ids):
    """fp32 [T * k, H]: y rows of the dense ops applied expert by expert to the rows routed to it."""
    top_k = ids.shape[1]
    y = torch.empty(ids.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in range(w_gate_up.shape[0]):
        entries = (flat == e).nonzero()[:, 0]
        if len(entries):
            a = silu_fn(linear_fn(x[entries // top_k], w_gate_up[e], None, x.dtype))
            y[entries] = linear_fn(a, w_down[e], None, torch.float32)
    return y


def _combine(y, weights, n_tokens):
    """fp32 [T, H]: slot-order sum of weights * y, as torch computes it."""
    return experts._slot_sum(weights.reshape(-1, 1) * y, n_tokens, weights.shape[1])


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


def test_interpreter_casts_bf16_by_truncation(small):
    y = torch.randn(64, 40)
    ids = torch.zeros(64, 1, dtype=torch.int64)
    got = small.core.combine(y, None, ids, 1, torch.bfloat16)
    assert torch.equal(got, _round_like_interpreter(y, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_dense_composition_interpreted(small, dense, shape, dtype):
    gemm, act = dense
    x, w_gate_up, w_down, ids, weights = _inputs(*shape, dtype=dtype)
    out = small.fwd.fused_moe_triton(x, w_gate_up, w_down, ids, weights)
    assert out.shape == x.shape and out.dtype == dtype
    y = _dense_expert_rows(gemm.linear_triton, act.silu_and_mul_triton, x, w_gate_up, w_down, ids)
    assert torch.equal(out, _round_like_interpreter(_combine(y, weights, shape[0]), dtype))
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # and close to the torch path
    torch.testing.assert_close(
        out.float(), fused_moe(x, w_gate_up, w_down, ids, weights).float(), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("seed", range(3))
def test_random_shapes_interpreted(small, dense, seed):
    """Random sizes and ids (repeats allowed), bf16: bitwise the dense composition, row alone = in batch."""
    gemm, act = dense
    gen = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    n_tokens, hidden, n_experts, inter = draw(2, 40), draw(8, 60), draw(4, 8), draw(3, 40)
    top_k = draw(1, 3)
    x, w_gate_up, w_down, _, weights = _inputs(n_tokens, hidden, n_experts, inter, top_k, torch.bfloat16)
    ids = torch.randint(0, n_experts, (n_tokens, top_k), generator=gen)
    out = small.fwd.fused_moe_triton(x, w_gate_up, w_down, ids, weights)
    y = _dense_expert_rows(gemm.linear_triton, act.silu_and_mul_triton, x, w_gate_up, w_down, ids)
    assert torch.equal(out, _round_like_interpreter(_combine(y, weights, n_tokens), torch.bfloat16))
    i = draw(0, n_tokens - 1)
    alone = small.fwd.fused_moe_triton(x[i : i + 1], w_gate_up, w_down, ids[i : i + 1], weights[i : i + 1])
    assert torch.equal(alone, out[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_interpreted(small, dtype):
    x, w_gate_up, w_down, ids, weights = _inputs(33, 40, 6, 24, 2, dtype)
    full = small.fwd.fused_moe_triton(x, w_gate_up, w_down, ids, weights)
    for i in (0, 16, 32):
        alone = small.fwd.fused_moe_triton(
            x[i : i + 1], w_gate_up, w_down, ids[i : i + 1], weights[i : i + 1]
        )
        assert torch.equal(alone, full[i : i + 1]), i
    rows = slice(5, 22)
    assert torch.equal(
        small.fwd.fused_moe_triton(x[rows], w_gate_up, w_down, ids[rows], weights[rows]), full[rows]
    )
    perm = torch.randperm(33)
    assert torch.equal(
        small.fwd.fused_moe_triton(x[perm], w_gate_up, w_down, ids[perm], weights[perm]), full[perm]
    )
    # padding rows (zero weights, expert 0) in the middle change nothing else
    x_pad = torch.cat([x[:7], torch.randn(9, 40).to(dtype), x[7:]])
    ids_pad = torch.cat([ids[:7], torch.zeros(9, 2, dtype=ids.dtype), ids[7:]])
    w_pad = torch.cat([weights[:7], torch.zeros(9, 2), weights[7:]])
    out = small.fwd.fused_moe_triton(x_pad, w_gate_up, w_down, ids_pad, w_pad)
    assert torch.equal(torch.cat([out[:7], out[16:]]), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_load_does_not_change_bits_interpreted(small, dtype):
    """Token 0 on experts (2, 0): alone; expert 2 receiving 41 tokens (several tiles); receiving 1."""
    x, w_gate_up, w_down, _, _ = _inputs(41, 40, 6, 24, 2, dtype)
    ids0, w0 = torch.tensor([[2, 0]]), torch.tensor([[0.7, 0.3]])
    alone = small.fwd.fused_moe_triton(x[:1], w_gate_up, w_down, ids0, w0)
    mates_w = torch.softmax(torch.randn(40, 2), -1)
    crowded = torch.stack([torch.full((40,), 2), torch.randint(3, 6, (40,))], 1)
    elsewhere = torch.stack([torch.randint(3, 6, (40,)), torch.full((40,), 1)], 1)
    for mates in (crowded, elsewhere):
        ids = torch.cat([mates[:20], ids0, mates[20:]]).contiguous()
        w = torch.cat([mates_w[:20], w0, mates_w[20:]])
        x_b = torch.cat([x[1:21], x[:1], x[21:]])
        assert torch.equal(small.fwd.fused_moe_triton(x_b, w_gate_up, w_down, ids, w)[20:21], alone)


def test_tile_shape_does_not_change_bits_interpreted(small, monkeypatch):
    """BLOCK_M (the layout's padding unit) and BLOCK_N only decide who computes a row; BLOCK_K is fixed."""
    x, w_gate_up, w_down, ids, weights = _inputs(17, 40, 5, 40, 2, torch.bfloat16)
    outs = []
    for block_m, block_n in ((16, 16), (32, 16), (16, 32), (64, 64)):
        cfg = _tile(small, block_m, block_n)
        monkeypatch.setattr(small.fwd, "forward_configs", lambda *_, c=cfg: (c, c))
        outs.append(small.fwd.fused_moe_triton(x, w_gate_up, w_down, ids, weights))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_block_k_is_the_dense_linears(mt):
    gemm = importlib.import_module("vexact_vllm.kernels.gemm.linear_triton")
    for dtype in (torch.bfloat16, torch.float32):
        for hidden, inter in ((2048, 768), (4096, 1536), (1024, 256), (40, 24), (7168, 2048)):
            gate_up, down = mt.fwd.forward_configs(hidden, inter, dtype)
            assert gate_up.block_k == gemm.gemm_config(2 * inter, hidden, dtype).block_k
            assert down.block_k == gemm.gemm_config(hidden, inter, dtype).block_k
            assert gate_up.block_m == down.block_m >= 64  # one layout; wgmma-sized tiles on CUDA


def _align_reference(topk_ids, n_experts, block_m):
    """The layout by torch ops (a stable sort of the ids): rows, tile_expert, tile_start, entry_row."""
    n = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    flat = torch.where((flat >= 0) & (flat < n_experts), flat, n_experts)  # bad ids: bucket E, no tiles
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = torch.searchsorted(sorted_ids, torch.arange(n_experts + 1))
    tiles = (starts[1:] - starts[:-1] + block_m - 1) // block_m
    tile_start = torch.zeros(n_experts + 1, dtype=torch.int64)
    tile_start[1:] = torch.cumsum(tiles, 0)
    num_tiles = -(-n // block_m) + min(n_experts, n)
    capacity = num_tiles * block_m
    safe = sorted_ids.clamp(max=n_experts - 1)
    dest = tile_start[safe] * block_m + torch.arange(n) - starts[safe]
    dest = torch.where(sorted_ids < n_experts, dest, capacity)
    rows = torch.full((capacity + 1,), -1, dtype=torch.int32)
    rows[dest] = order.to(torch.int32)
    entry_row = torch.empty(n, dtype=torch.int64)
    entry_row[order] = dest
    tile_expert = torch.searchsorted(tile_start[1:], torch.arange(num_tiles), right=True)
    return rows[:capacity], tile_expert.to(torch.int32), tile_start.to(torch.int32), entry_row


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_layout(mt, block_m):
    cases = ((1, 8, 3), (17, 6, 2), (100, 4, 1), (33, 128, 8), (70, 300, 4), (9, 5, 5), (600, 8, 2))
    for n_tokens, n_experts, top_k in cases:
        ids = torch.rand(n_tokens, n_experts).argsort(-1)[:, :top_k].contiguous()
        if n_tokens == 100:
            ids.zero_()  # every entry on expert 0
        layout = mt.align.align(ids, n_experts, block_m)
        flat = ids.reshape(-1)
        n = flat.numel()
        assert layout.rows.numel() == (-(-n // block_m) + min(n_experts, n)) * block_m
        for e in range(n_experts):
            t0, t1 = layout.tile_start[e].item(), layout.tile_start[e + 1].item()
            seg = layout.rows[t0 * block_m : t1 * block_m]
            want = (flat == e).nonzero()[:, 0]
            assert torch.equal(seg[: len(want)].long(), want)  # ascending (token, slot) order
            assert (seg[len(want) :] == -1).all() and t1 - t0 == -(-len(want) // block_m)
            assert (layout.tile_expert[t0:t1] == e).all()
        used = layout.tile_start[-1].item()
        assert (layout.tile_expert[used:] == n_experts).all() and (layout.rows[used * block_m :] == -1).all()
        assert torch.equal(layout.rows[layout.entry_row].long(), torch.arange(n))
        for got, want in zip(layout[:4], _align_reference(ids, n_experts, block_m)):
            assert torch.equal(got, want)


def test_align_bad_ids_and_int32(mt):
    """Ids outside [0, E) (not refused on CUDA) get the spare row and no tile; int32 ids, the same
    layout as int64; more entries than one chunk's worth with a large E (several chunks, scan steps)."""
    ids = torch.randint(-2, 9, (300, 3))  # E = 7: -2, -1, 7, 8 are bad
    for block_m in (16, 64):
        layout = mt.align.align(ids, 7, block_m)
        for got, want in zip(layout[:4], _align_reference(ids, 7, block_m)):
            assert torch.equal(got, want)
        bad = ((ids < 0) | (ids >= 7)).reshape(-1)
        assert (layout.entry_row[bad] == layout.rows.numel()).all()
        assert torch.equal(mt.align.align(ids.int(), 7, block_m)[0], layout.rows)
    ids = torch.randint(0, 1000, (200, 8))
    for got, want in zip(mt.align.align(ids, 1000, 64)[:4], _align_reference(ids, 1000, 64)):
        assert torch.equal(got, want)
    empty = mt.align.align(ids[:0], 1000, 64)
    assert empty.rows.numel() == empty.tile_expert.numel() == empty.entry_row.numel() == 0


def test_combine_equals_torch_and_poisons_bad_ids(small):
    """The combine kernel is torch's w * y then slot-order + (no FMA); an id outside [0, E) (not refused
    on CUDA, where the values are never read back) gives a NaN row instead of an out-of-bounds read."""
    y = torch.randn(17 * 3, 40)
    y[5] = -0.0
    weights = torch.softmax(torch.randn(17, 3), -1)
    ids = torch.randint(0, 6, (17, 3))
    assert torch.equal(
        small.core.combine(y, weights.reshape(-1), ids, 6, torch.float32), _combine(y, weights, 17)
    )
    x, w_gate_up, w_down, ids, weights = _inputs(17, 40, 6, 24, 2)
    good = small.fwd._forward(x, w_gate_up, w_down, ids, weights)[0]
    bad = ids.clone()
    bad[3, 1], bad[9, 0] = 6, -1
    out = small.fwd._forward(x, w_gate_up, w_down, bad, weights)[0]
    assert out[[3, 9]].isnan().all()
    keep = [t for t in range(17) if t not in (3, 9)]
    assert torch.equal(out[keep], good[keep])


def _grads(fn, x, w_gate_up, w_down, ids, weights, g):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    (fn(leaves[0], leaves[1], leaves[2], ids, leaves[3]).float() * g).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(17, 40, 6, 24, 2), (33, 24, 8, 20, 3), (5, 50, 4, 12, 1)])
def test_backward_matches_torch_path_interpreted(small, shape, dtype):
    inputs = _inputs(*shape, dtype=dtype)
    ids = inputs[3]
    g = torch.randn(shape[0], shape[1])
    got = _grads(small.fwd.fused_moe_triton, *inputs, g)
    want = _grads(fused_moe, *inputs, g)
    assert [t.dtype for t in got] == [dtype] * 3 + [torch.float32]
    for name, a, b in zip(("x", "w_gate_up", "w_down", "weights"), got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        else:  # bf16 gu, a and dGU (and the interpreter's truncating casts): relative to the largest entry
            scale = b.float().abs().max()
            torch.testing.assert_close(a.float() / scale, b.float() / scale, rtol=0, atol=3e-2, msg=name)
    for e in sorted(set(range(shape[2])) - set(ids.flatten().tolist())):  # unrouted experts: exact zeros
        assert not got[1][e].any() and not got[2][e].any()
    again = _grads(small.fwd.fused_moe_triton, *inputs, g)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # deterministic


def test_partial_gradients_and_empty_batch_interpreted(small):
    x, w_gate_up, w_down, ids, weights = _inputs(9, 40, 4, 24, 2)
    full = _grads(small.fwd.fused_moe_triton, x, w_gate_up, w_down, ids, weights, torch.ones(9, 40))
    xg = x.clone().requires_grad_()
    small.fwd.fused_moe_triton(xg, w_gate_up, w_down, ids, weights).sum().backward()
    assert torch.equal(xg.grad, full[0])
    wg = w_down.clone().requires_grad_()
    small.fwd.fused_moe_triton(x, w_gate_up, wg, ids, weights).sum().backward()
    assert torch.equal(wg.grad, full[2])
    empty = small.fwd.fused_moe_triton(x[:0], w_gate_up, w_down, ids[:0], weights[:0])
    assert empty.shape == (0, 40)
    grads = _grads(
        small.fwd.fused_moe_triton, x[:0], w_gate_up, w_down, ids[:0], weights[:0], torch.ones(0, 40)
    )
    assert grads[0].shape == (0, 40) and not grads[1].any() and not grads[2].any()


def test_dispatch_reaches_the_triton_function(small, monkeypatch):
    """`experts._IMPLS["triton"]` imports the module lazily; here it finds the interpreted one."""
    monkeypatch.setitem(sys.modules, MODULES[0], small.fwd)
    inputs = _inputs(9, 40, 4, 24, 2, torch.bfloat16)
    assert torch.equal(experts._IMPLS["triton"](*inputs), small.fwd.fused_moe_triton(*inputs))


@pytest.mark.parametrize(
    "case",
    ["half", "dtype mismatch", "k mismatch", "id = E", "id < 0", "w_down shape", "x strided", "weights bf16"],
)
def test_bad_input_raises_interpreted(mt, case):
    x, w_gate_up, w_down, ids, weights = _inputs(4, 16, 3, 8, 2)
    args = {
        "half": (x.half(), w_gate_up.half(), w_down.half(), ids, weights),
        "dtype mismatch": (x.bfloat16(), w_gate_up, w_down, ids, weights),
        "k mismatch": (x, w_gate_up, w_down, ids, weights[:, :1].contiguous()),
        "id = E": (x, w_gate_up, w_down, torch.full_like(ids, 3), weights),
        "id < 0": (x, w_gate_up, w_down, torch.full_like(ids, -1), weights),
        "w_down shape": (x, w_gate_up, w_down[:, :, :7].contiguous(), ids, weights),
        "x strided": (torch.randn(16, 4).t(), w_gate_up, w_down, ids, weights),
        "weights bf16": (x, w_gate_up, w_down, ids, weights.bfloat16()),
    }[case]
    with pytest.raises(ValueError):
        mt.fwd.fused_moe_triton(*args)


def test_cpu_tensors_refused_by_compiled_kernel(mt):
    compiled = importlib.import_module(MODULES[0])
    assert compiled is not mt.fwd
    with pytest.raises(ValueError, match="CUDA"):
        compiled.fused_moe_triton(*_inputs(4, 16, 3, 8, 2))


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels; Qwen3-30B-A3B experts: H 2048, I 768, E 128, top-8, bf16)
# ---------------------------------------------------------------------------------------------

QWEN3_MOE = (2048, 128, 768, 8)  # (H, E, I, k)


def _cuda_inputs(n_tokens, dtype=torch.bfloat16, shape=QWEN3_MOE):
    hidden, n_experts, inter, top_k = shape
    return _inputs(n_tokens, hidden, n_experts, inter, top_k, dtype, device="cuda")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_tokens", [1, 7, 300, 2049])
def test_equals_dense_triton_composition_cuda(n_tokens, dtype):
    """Bitwise the dense Triton ops (`linear`, `silu_and_mul` on CUDA tensors) expert by expert, then
    torch's slot-order combine: `experts._fused_moe_torch_forward` on CUDA outside reference mode."""
    from vexact_vllm.kernels.moe.experts_triton import fused_moe_triton

    inputs = _cuda_inputs(n_tokens, dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "_CUDA_BACKEND", "triton")
        want = experts._fused_moe_torch_forward(*inputs)
        assert torch.equal(fused_moe_triton(*inputs), want)
        assert torch.equal(fused_moe(*inputs), want)


@pytest.mark.cuda
@requires_cuda
def test_batch_invariant_cuda():
    from vexact_vllm.kernels.moe.experts_triton import fused_moe_triton

    x, w_gate_up, w_down, ids, weights = _cuda_inputs(1100)
    full = fused_moe_triton(x, w_gate_up, w_down, ids, weights)
    for m in (1, 2, 63, 64, 65, 300, 1099):
        assert torch.equal(fused_moe_triton(x[:m], w_gate_up, w_down, ids[:m], weights[:m]), full[:m]), m
    for i in (0, 517, 1099):
        alone = fused_moe_triton(x[i : i + 1], w_gate_up, w_down, ids[i : i + 1], weights[i : i + 1])
        assert torch.equal(alone, full[i : i + 1]), i
    perm = torch.randperm(1100, device="cuda")
    assert torch.equal(fused_moe_triton(x[perm], w_gate_up, w_down, ids[perm], weights[perm]), full[perm])
    # token 0's experts each receiving all 1100 tokens, or token 0 alone (a token may repeat an expert)
    crowded = ids.clone()
    crowded[1:, :2] = ids[0, :2]
    free = next(e for e in range(128) if e not in ids[0].tolist())
    lonely = torch.where(torch.isin(ids, ids[0]), free, ids)
    lonely[0] = ids[0]
    for batch_ids in (crowded, lonely):
        out = fused_moe_triton(x, w_gate_up, w_down, batch_ids.contiguous(), weights)
        assert torch.equal(out[:1], full[:1])


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_replay_equals_eager():
    """No host synchronisation: the forward captures in a CUDA graph and replays to the eager bits."""
    from vexact_vllm.kernels.moe.experts_triton import fused_moe_triton

    inputs = _cuda_inputs(64)
    eager = fused_moe_triton(*inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe_triton(*inputs)  # warm-up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        captured = fused_moe_triton(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_cuda(dtype):
    from vexact_vllm.kernels.moe.experts_triton import fused_moe_triton

    inputs = _cuda_inputs(300, dtype, shape=(512, 16, 192, 4))
    g = torch.randn(300, 512, device="cuda")
    got = _grads(fused_moe_triton, *inputs, g)
    with reference_mode():
        want = _grads(fused_moe, *inputs, g)
    for name, a, b in zip(("x", "w_gate_up", "w_down", "weights"), got, want):
        scale = b.float().abs().max()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(a.float() / scale, b.float() / scale, rtol=0, atol=tol, msg=name)
    again = _grads(fused_moe_triton, *inputs, g)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
