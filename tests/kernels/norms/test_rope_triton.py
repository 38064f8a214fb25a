"""Triton RoPE: the interpreter on CPU tensors (tiny shapes), the compiled kernel on CUDA."""

import importlib

import pytest
import torch

pytest.importorskip("triton")  # imported here, in compiled mode, before any interpreted import

from vexact_vllm.kernels import apply_rope, dispatch, rope_cache  # noqa: E402

MODULE = "vexact_vllm.kernels.norms.rope_triton"
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")



@pytest.fixture(scope="module")
def interpreted(interpreted_modules):
    """(rope_triton, rms_norm_triton) interpreted; the second is the module the first imports."""
    return interpreted_modules((MODULE, "vexact_vllm.kernels.norms.rms_norm_triton"))


@pytest.fixture(scope="module")
def tk(interpreted):
    return interpreted[0]


@pytest.fixture(scope="module")
def tnorm(interpreted):
    return interpreted[1]


def _reference(x, positions, cache):
    """fp64 rotate_half with the angles recovered from the fp32 cache."""
    half = cache.shape[1] // 2
    rows = cache[positions.long()].double()  # [T, R]
    cos = torch.cat([rows[:, :half], rows[:, :half]], -1)[:, None, :]
    sin = torch.cat([rows[:, half:], rows[:, half:]], -1)[:, None, :]
    xr = x[..., : 2 * half].double()
    x1, x2 = xr.chunk(2, -1)
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, x[..., 2 * half :].double()], -1)


def _check(mod, q, k, positions, cache, tol):
    q_out, k_out = mod.apply_rope_triton(q, k, positions, cache)
    assert q_out.dtype == q.dtype and q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out.double(), _reference(q, positions, cache), rtol=tol, atol=tol)
    torch.testing.assert_close(k_out.double(), _reference(k, positions, cache), rtol=tol, atol=tol)
    rot = cache.shape[1]
    assert torch.equal(q_out[..., rot:], q[..., rot:]) and torch.equal(k_out[..., rot:], k[..., rot:])
    n = q.shape[0]
    for t in (0, n // 2, n - 1):
        q1, k1 = mod.apply_rope_triton(q[t : t + 1], k[t : t + 1], positions[t : t + 1], cache)
        assert torch.equal(q1, q_out[t : t + 1]) and torch.equal(k1, k_out[t : t + 1])
    q5, k5 = mod.apply_rope_triton(q[:5], k[:5], positions[:5], cache)
    assert torch.equal(q5, q_out[:5]) and torch.equal(k5, k_out[:5])
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,partial", [(32, 1.0), (40, 0.5), (24, 1.0)])
def test_accuracy_and_invariance(tk, dtype, head_dim, partial):
    cache = rope_cache(head_dim, 64, 10000.0, partial_rotary_factor=partial)
    positions = torch.randint(0, 64, (17,))
    q = torch.randn(17, 3, head_dim).to(dtype)
    k = torch.randn(17, 1, head_dim).to(dtype)
    _check(tk, q, k, positions, cache, TOL[dtype])


def test_strided_inputs_and_int32_positions(tk):
    cache = rope_cache(16, 32, 10000.0)
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    q = qkv[:, : 4 * 16].view(5, 4, 16)  # token stride 128: a view of a fused qkv projection
    k = qkv[:, 4 * 16 : 6 * 16].view(5, 2, 16)
    positions = torch.tensor([3, 0, 31, 7, 7], dtype=torch.int32)
    q_out, k_out = tk.apply_rope_triton(q, k, positions, cache)
    q_ref, k_ref = tk.apply_rope_triton(q.contiguous(), k.contiguous(), positions.long(), cache)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    empty = torch.randn(0, 4, 16)
    assert tk.apply_rope_triton(empty, empty, torch.zeros(0, dtype=torch.long), cache)[0].shape == (0, 4, 16)


def test_gradients_match_float64_reference(tk):
    cache = rope_cache(40, 64, 10000.0, partial_rotary_factor=0.5)
    positions = torch.randint(0, 64, (5,))
    q = torch.randn(5, 3, 40, requires_grad=True)
    k = torch.randn(5, 1, 40, requires_grad=True)
    gq, gk = torch.randn(5, 3, 40), torch.randn(5, 1, 40)
    q_out, k_out = tk.apply_rope_triton(q, k, positions, cache)
    ((q_out * gq).sum() + (k_out * gk).sum()).backward()
    qd, kd = (t.detach().double().requires_grad_() for t in (q, k))
    (
        (_reference(qd, positions, cache) * gq.double()).sum()
        + (_reference(kd, positions, cache) * gk.double()).sum()
    ).backward()
    torch.testing.assert_close(q.grad.double(), qd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad.double(), kd.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "q,k,positions",
    [
        (torch.randn(4, 2, 16).half(), torch.randn(4, 2, 16).half(), torch.arange(4)),
        (torch.randn(4, 2, 16), torch.randn(4, 2, 16).bfloat16(), torch.arange(4)),
        (torch.randn(4, 2, 16), torch.randn(3, 2, 16), torch.arange(4)),
        (torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.arange(4).float()),
        (torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.tensor([0, 1, 2, 99])),
        (torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.tensor([0, -1, 2, 3])),
        (torch.randn(4, 32), torch.randn(4, 32), torch.arange(4)),
        (torch.randn(4, 2, 32)[..., ::2], torch.randn(4, 2, 16), torch.arange(4)),
    ],
)
def test_bad_input_raises(tk, q, k, positions):
    with pytest.raises(ValueError):
        tk.apply_rope_triton(q, k, positions, rope_cache(16, 8, 10000.0))


def test_bad_cache_raises(tk):
    q = torch.randn(2, 2, 16)
    for cache in (rope_cache(16, 8, 10000.0).double(), rope_cache(32, 8, 10000.0), torch.randn(8, 7)):
        with pytest.raises(ValueError):
            tk.apply_rope_triton(q, q, torch.arange(2), cache)


def _qkv_views(t, hq, hkv, d, dtype, device="cpu"):
    """q [T, Hq, D], k [T, Hkv, D]: strided views of one fused q/k/v projection output, as in the model."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device).to(dtype)
    return qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)


def _heads_per_program_gives_the_same_bits(mod, monkeypatch, t, hq, hkv, d, cache, device="cpu"):
    """Every HEADS_PER_PROGRAM (speed only) gives the bits of one head a program, forward and the
    backward's rotation, with and without the norm; q/k head counts not multiples of it."""
    q, k = _qkv_views(t, hq, hkv, d, torch.bfloat16, device)
    positions = torch.randint(0, cache.shape[0], (t,), device=device)
    norm = _norm_weights(d, torch.bfloat16, device) + (1e-6,)
    results = {}
    monkeypatch.setattr(mod, "_FEW_PROGRAMS", 0)  # every launch takes HEADS_PER_PROGRAM as is
    for heads in (1, 2, 3, 4, 8):
        monkeypatch.setattr(mod, "HEADS_PER_PROGRAM", heads)
        results[heads] = [
            *mod._launch(q, k, positions, cache, norm), *mod._launch(q, k, positions, cache, inverse=True)[:2]
        ]
    for heads, got in results.items():
        for a, b in zip(got, results[1], strict=True):
            assert torch.equal(a, b), heads


def test_heads_a_program_follow_the_launch_size(tk):
    """Four heads a program, halved while the launch would have fewer than 1,024 programs (the 8B
    shape's 40 heads: one at 16 tokens, four from 128)."""
    assert [tk._heads_for(t, 40) for t in (1, 16, 32, 64, 128, 8192)] == [1, 1, 1, 2, 4, 4]
    assert tk._heads_for(256, 1) == 1 and tk._heads_for(10**6, 3) == 4


def test_heads_per_program_is_speed_only(tk, monkeypatch):
    hkv = int(torch.randint(1, 4, ()))
    cache = rope_cache(32, 64, 10000.0)
    _heads_per_program_gives_the_same_bits(tk, monkeypatch, 5, hkv * int(torch.randint(1, 4, ())), hkv, 32, cache)


def _norm_weights(d, dtype, device="cpu"):
    return (1 + 0.3 * torch.randn(d, device=device)).to(dtype), (1 + 0.3 * torch.randn(d, device=device)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,partial", [(32, 1.0), (40, 0.5), (24, 1.0), (16, 0.5), (64, 1.0)])
def test_qk_norm_is_rms_norm_then_rope(tk, tnorm, dtype, head_dim, partial):
    """One launch gives the bits of the norm kernel then the rotation, and the torch path's values."""
    cache = rope_cache(head_dim, 64, 10000.0, partial_rotary_factor=partial)
    t, hq, hkv = int(torch.randint(1, 19, ())), int(torch.randint(1, 5, ())), int(torch.randint(1, 3, ()))
    q, k = _qkv_views(t, hq, hkv, head_dim, dtype)
    positions = torch.randint(0, 64, (t,))
    wq, wk = _norm_weights(head_dim, dtype)
    q_out, k_out = tk.apply_rope_triton(q, k, positions, cache, (wq, wk, 1e-6))
    q_sep, k_sep = tk.apply_rope_triton(
        tnorm.rms_norm_triton(q, wq, 1e-6), tnorm.rms_norm_triton(k, wk, 1e-6), positions, cache
    )
    assert torch.equal(q_out, q_sep) and torch.equal(k_out, k_sep)
    q_ref, k_ref = apply_rope(q, k, positions, cache, (wq, wk, 1e-6))  # CPU: the torch path
    torch.testing.assert_close(q_out.float(), q_ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(k_out.float(), k_ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    for r in (0, t - 1):  # a token alone: the same bits
        q1, k1 = tk.apply_rope_triton(q[r : r + 1], k[r : r + 1], positions[r : r + 1], cache, (wq, wk, 1e-6))
        assert torch.equal(q1, q_out[r : r + 1]) and torch.equal(k1, k_out[r : r + 1])


def _check_qk_norm_gradients(mod, shape, head_dim, partial, tol, device="cpu"):
    """q/k/weight gradients of the fused norm + rotation against fp64 autograd; shape = (T, Hq, Hkv)."""
    t, hq, hkv = shape
    cache = rope_cache(head_dim, 4096, 10000.0, partial_rotary_factor=partial).to(device)
    positions = torch.randint(0, 4096, (t,), device=device)
    q = torch.randn(t, hq, head_dim, device=device, requires_grad=True)
    k = torch.randn(t, hkv, head_dim, device=device, requires_grad=True)
    wq, wk = (w.requires_grad_() for w in _norm_weights(head_dim, torch.float32, device))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    q_out, k_out = mod.apply_rope_triton(q, k, positions, cache, (wq, wk, 1e-6))
    ((q_out * gq).sum() + (k_out * gk).sum()).backward()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, wq, wk)]
    qd, kd, wqd, wkd = leaves

    def norm(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    (
        (_reference(norm(qd, wqd), positions, cache) * gq.double()).sum()
        + (_reference(norm(kd, wkd), positions, cache) * gk.double()).sum()
    ).backward()
    for got, want in zip((q, k, wq, wk), leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=tol, atol=tol)
    k_only = mod.apply_rope_triton(q, k, positions, cache, (wq, wk, 1e-6))[1]  # q's gradient missing
    (dk,) = torch.autograd.grad(k_only.sum(), [k])
    assert dk.shape == k.shape and torch.isfinite(dk).all()


def test_qk_norm_gradients_match_float64_reference(tk):
    _check_qk_norm_gradients(tk, (5, 3, 2), 40, 0.5, 1e-4)


@pytest.mark.parametrize(
    "qk_norm",
    [
        (torch.ones(16), torch.ones(15), 1e-6),
        (torch.ones(16), torch.ones(16).double(), 1e-6),
        (torch.ones(16), torch.ones(16), -1.0),
        (torch.ones(16), torch.ones(16)),
        [torch.ones(16), torch.ones(16), 1e-6],
    ],
)
def test_bad_qk_norm_raises(tk, qk_norm):
    q = torch.randn(2, 2, 16)
    with pytest.raises(ValueError):
        tk.apply_rope_triton(q, q, torch.arange(2), rope_cache(16, 8, 10000.0), qk_norm)
    with pytest.raises(ValueError):
        apply_rope(q, q, torch.arange(2), rope_cache(16, 8, 10000.0), qk_norm)


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernel, real sizes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_cuda_accuracy_and_invariance(dtype, partial):
    mod = importlib.import_module(MODULE)
    cache = rope_cache(128, 40960, 1000000.0, partial_rotary_factor=partial).cuda()
    positions = torch.randint(0, 40960, (300,), device="cuda")
    q = torch.randn(300, 32, 128, device="cuda").to(dtype)
    k = torch.randn(300, 8, 128, device="cuda").to(dtype)
    q_out, k_out = _check(mod, q, k, positions, cache, TOL[dtype])
    for m in (2, 64, 257):
        q_m, k_m = mod.apply_rope_triton(q[:m], k[:m], positions[:m], cache)
        assert torch.equal(q_m, q_out[:m]) and torch.equal(k_m, k_out[:m])
    with pytest.MonkeyPatch.context() as mp:  # the public op on the Triton backend is this kernel
        mp.setattr(dispatch, "_CUDA_BACKEND", "triton")
        q_pub, k_pub = apply_rope(q, k, positions, cache)
        assert torch.equal(q_pub, q_out) and torch.equal(k_pub, k_out)


@pytest.mark.cuda
@requires_cuda
def test_cuda_gradients():
    mod = importlib.import_module(MODULE)
    cache = rope_cache(128, 4096, 10000.0).cuda()
    positions = torch.randint(0, 4096, (300,), device="cuda")
    q = torch.randn(300, 16, 128, device="cuda", requires_grad=True)
    k = torch.randn(300, 4, 128, device="cuda", requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    q_out, k_out = mod.apply_rope_triton(q, k, positions, cache)
    ((q_out * gq).sum() + (k_out * gk).sum()).backward()
    qd, kd = (t.detach().double().requires_grad_() for t in (q, k))
    (
        (_reference(qd, positions, cache) * gq.double()).sum()
        + (_reference(kd, positions, cache) * gk.double()).sum()
    ).backward()
    torch.testing.assert_close(q.grad.double(), qd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad.double(), kd.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_qk_norm_equals_norm_then_rope(head_dim):
    """The fused launch against the two kernels it replaces, bitwise: strided views of a fused
    projection, random head counts and batch sizes, every token alone and in sub-batches."""
    mod = importlib.import_module(MODULE)
    norm = importlib.import_module("vexact_vllm.kernels.norms.rms_norm_triton")
    cache = rope_cache(head_dim, 40960, 1000000.0).cuda()
    for _ in range(4):
        t = int(torch.randint(1, 600, ()))
        hkv = int(torch.randint(1, 9, ()))
        hq = hkv * int(torch.randint(1, 5, ()))
        q, k = _qkv_views(t, hq, hkv, head_dim, torch.bfloat16, "cuda")
        q, k = q * 3, k * 3
        positions = torch.randint(0, 40960, (t,), device="cuda")
        wq, wk = _norm_weights(head_dim, torch.bfloat16, "cuda")
        q_out, k_out = mod.apply_rope_triton(q, k, positions, cache, (wq, wk, 1e-6))
        q_sep, k_sep = mod.apply_rope_triton(
            norm.rms_norm_triton(q, wq, 1e-6), norm.rms_norm_triton(k, wk, 1e-6), positions, cache
        )
        assert torch.equal(q_out, q_sep) and torch.equal(k_out, k_sep)
        for m in (1, 7, t // 2 + 1):
            start = int(torch.randint(0, t - m + 1, ()))
            rows = slice(start, start + m)
            q_m, k_m = mod.apply_rope_triton(q[rows], k[rows], positions[rows], cache, (wq, wk, 1e-6))
            assert torch.equal(q_m, q_out[rows]) and torch.equal(k_m, k_out[rows])


@pytest.mark.cuda
@requires_cuda
def test_cuda_heads_per_program_is_speed_only(monkeypatch):
    cache = rope_cache(128, 40960, 1000000.0).cuda()
    for hq, hkv in ((32, 8), (16, 8), (28, 4), (5, 1)):
        _heads_per_program_gives_the_same_bits(importlib.import_module(MODULE), monkeypatch, 300, hq, hkv, 128, cache, "cuda")


@pytest.mark.cuda
@requires_cuda
def test_cuda_qk_norm_gradients():
    _check_qk_norm_gradients(importlib.import_module(MODULE), (300, 16, 4), 128, 1.0, 1e-3, "cuda")
