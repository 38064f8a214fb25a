"""Triton GEMM (`kernels/gemm/linear_triton.py`): the kernel's logic on CPU through the Triton interpreter
(tiny shapes, 16x16x16 tiles so they span several tiles, K steps and persistent programs), and the
compiled kernel on CUDA at Qwen3 weight shapes. Invariance is always `torch.equal`."""

import dataclasses
import importlib
import random
import sys

import numpy as np
import pytest
import torch

from vexact_vllm.kernels.gemm import linear as gemm

pytest.importorskip("triton")

MODULE = "vexact_vllm.kernels.gemm.linear_triton"
_BF16 = torch.bfloat16
# Accuracy against fp64, by output dtype: inputs are exact in both, so the fp32 accumulation of up
# to 6144 products (fp32 out) or the final rounding (bf16 out) sets the error.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture(autouse=True)
def _triton_kernel_only(monkeypatch):
    """These tests are the Triton kernel's: no launch takes the CuTe-DSL path (tests in
    test_linear_cute.py hold that path to this kernel's bits)."""
    from vexact_vllm.kernels.gemm import linear_cute

    monkeypatch.setattr(linear_cute, "takes", lambda *args: False)


def _reference(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _inputs(m, n, k, dtype, device="cpu", bias=True):
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, b


@pytest.fixture(scope="module")
def interp(interpreted_modules):
    """linear_triton (and the modules its kernels call) imported afresh with TRITON_INTERPRET=1 (it
    takes CPU tensors); later imports (the CUDA tests, vLLM engines started in the same run) get the
    compiled kernels (tests/conftest.py's `import_interpreted_modules`)."""
    return interpreted_modules((MODULE,))[0]


@pytest.fixture(scope="module")
def interp_runs(interp):
    """`interp`, skipped where this Triton's interpreter cannot run a loop (Triton 3.6 calls int() on
    1-element arrays, which numpy >= 2.5 refuses); the CUDA tests still cover the kernel there."""
    try:
        interp.linear_triton(torch.ones(1, 16), torch.ones(16, 16), None, torch.float32)
    except Exception as e:
        if "0-dimensional arrays" in str(e):
            pytest.skip(f"Triton's interpreter fails with numpy {np.__version__}: {e}")
        raise
    return interp


@pytest.fixture
def small_tiles(interp_runs, monkeypatch):
    """Every weight shape gets 16x16x16 tiles: tiny problems then have many tiles and K steps."""
    config = interp_runs.GemmConfig(16, 16, 16, 2, 4, 2)
    monkeypatch.setattr(interp_runs, "gemm_config", lambda *_: config)
    return interp_runs


# ----------------------------------------------------------------------------- interpreter (CPU)


@pytest.mark.parametrize("m,n,k", [(1, 16, 24), (5, 40, 64), (17, 40, 24), (33, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy_interpreted(small_tiles, m, n, k, dtype):
    x, w, b = _inputs(m, n, k, dtype, bias=m % 2 == 1)
    for out_dtype in (torch.float32, torch.bfloat16):
        y = small_tiles.linear_triton(x, w, b, out_dtype)
        assert y.shape == (m, n) and y.dtype == out_dtype
        tol = TOL[out_dtype]
        torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=tol, atol=tol)


def test_default_config_interpreted(interp_runs):
    """The real configuration table: one tile larger than the whole problem, masked everywhere."""
    x, w, b = _inputs(17, 40, 24, torch.bfloat16)
    y = interp_runs.linear_triton(x, w, b, torch.float32)
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,dtype", [(40, 24, torch.bfloat16), (16, 64, torch.float32)])
def test_rows_invariant_interpreted(small_tiles, monkeypatch, n, k, dtype):
    x, w, b = _inputs(33, n, k, dtype)
    full = small_tiles.linear_triton(x, w, b, torch.bfloat16)
    for i in range(33):
        assert torch.equal(small_tiles.linear_triton(x[i : i + 1], w, b, torch.bfloat16), full[i : i + 1]), i
    for size in (5, 17):
        for start in range(0, 33, size):
            part = small_tiles.linear_triton(x[start : start + size], w, b, torch.bfloat16)
            assert torch.equal(part, full[start : start + size]), (size, start)
    for sms in (1, 3, 7):  # fewer or more persistent programs than tiles
        monkeypatch.setattr(small_tiles, "num_sms", lambda device, sms=sms: sms)
        assert torch.equal(small_tiles.linear_triton(x, w, b, torch.bfloat16), full), sms


def test_strided_views_interpreted(small_tiles):
    x, w, b = _inputs(17, 40, 24, torch.bfloat16)
    want = small_tiles.linear_triton(x, w, b, torch.float32)
    x_wide = torch.zeros(17, 40, dtype=x.dtype)
    x_wide[:, 8:32] = x
    x_every_other = torch.zeros(34, 24, dtype=x.dtype)
    x_every_other[::2] = x
    w_wide = torch.zeros(40, 30, dtype=w.dtype)
    w_wide[:, 3:27] = w
    for xv in (x_wide[:, 8:32], x_every_other[::2]):
        assert xv.stride(0) != 24
        assert torch.equal(small_tiles.linear_triton(xv, w_wide[:, 3:27], b, torch.float32), want)


def test_autograd_function_interpreted(small_tiles, monkeypatch):
    """`gemm._IMPLS["triton"]` imports the module lazily; here it finds the interpreted one."""
    monkeypatch.setitem(sys.modules, MODULE, small_tiles)
    x, w, b = (t.requires_grad_() for t in _inputs(9, 40, 24, torch.float32))
    g = torch.randn(9, 40)
    (gemm._IMPLS["triton"](x, w, b, torch.float32) * g).sum().backward()
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    (_reference(xd, wd, bd) * g.double()).sum().backward()
    for got, want in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_no_grad_forward_equals_autograd_forward_interpreted(small_tiles, monkeypatch):
    """Without a gradient to track, `linear` skips the autograd Function (host time on the decode
    step's eager lm_head): the same bits, and no graph node; with one, the Function runs."""
    monkeypatch.setitem(sys.modules, MODULE, small_tiles)
    monkeypatch.setattr(gemm, "backend_for", lambda t: "triton")
    x, w, b = _inputs(9, 40, 24, torch.float32)
    plain = gemm.linear(x, w, b, torch.float32)
    assert plain.grad_fn is None
    with torch.inference_mode():
        assert torch.equal(gemm.linear(x, w, b, torch.float32), plain)
    tracked = gemm.linear(x, w.requires_grad_(), b, torch.float32)
    assert tracked.grad_fn is not None and torch.equal(tracked.detach(), plain)
    with torch.no_grad():
        assert gemm.linear(x, w, b, torch.float32).grad_fn is None


@pytest.mark.parametrize(
    "x,w,b,out_dtype",
    [
        (torch.randn(2, 8).half(), torch.randn(4, 8).half(), None, torch.float32),
        (torch.ones(2, 8, dtype=torch.int64), torch.ones(4, 8, dtype=torch.int64), None, torch.float32),
        (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, torch.float32),
        (torch.randn(2, 8), torch.randn(4, 9), None, torch.float32),
        (torch.randn(2, 1, 8), torch.randn(4, 8), None, torch.float32),
        (torch.randn(2, 8), torch.randn(4, 8, 1), None, torch.float32),
        (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), torch.float32),
        (torch.randn(2, 8), torch.randn(4, 8), torch.randn(8)[::2], torch.float32),
        (torch.randn(2, 8), torch.randn(4, 8), torch.ones(4, dtype=torch.int32), torch.float32),
        (torch.randn(2, 8), torch.randn(4, 8), None, torch.float16),
        (torch.randn(8, 2).t(), torch.randn(4, 8), None, torch.float32),
        (torch.randn(2, 8), torch.randn(8, 4).t(), None, torch.float32),
    ],
)
def test_bad_input_raises(interp, x, w, b, out_dtype):
    with pytest.raises(ValueError):
        interp.linear_triton(x, w, b, out_dtype)


def test_cpu_tensors_refused_by_compiled_kernel(interp):
    compiled = importlib.import_module(MODULE)
    assert compiled is not interp
    with pytest.raises(ValueError, match="CUDA"):
        compiled.linear_triton(torch.randn(2, 8), torch.randn(4, 8), None, torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_tma_kernel_equals_pointer_kernel_interpreted(interp_runs, monkeypatch, bias):
    """Tensor-descriptor loads (zero-filled past M, N and the K tail) give the pointer kernel's bits."""
    x, w, b = _inputs(37, 48, 40, torch.bfloat16, bias=bias)  # K = 40: a K tail for BLOCK_K = 16
    outs = []
    for tma in (False, True):
        config = interp_runs.GemmConfig(16, 32, 16, 2, 4, 2, 1, tma)
        monkeypatch.setattr(interp_runs, "gemm_config", lambda *_, c=config: c)
        outs.append([interp_runs.linear_triton(x, w, b, dt) for dt in (torch.float32, torch.bfloat16)])
    assert all(torch.equal(p, t) for p, t in zip(*outs))
    torch.testing.assert_close(outs[1][0].double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_k_split_is_the_sum_of_two_halves_interpreted(interp_runs, monkeypatch, tma, bias):
    """k_split = 2: y = p_0 + p_1 + b, p_s the one-part kernel on K half s (fp32 out), for one program
    per tile (pointer or TMA loads) and for two programs meeting through the tickets; bf16 out the
    same bits both ways."""
    gt = interp_runs
    rng = np.random.default_rng(7)
    for _ in range(3):
        m, n = int(rng.integers(1, 40)), int(rng.integers(1, 50))
        k = 2 * 16 * int(rng.integers(1, 4)) + (0 if tma else 2 * int(rng.integers(0, 8)))  # part tails
        x, w, b = _inputs(m, n, k, torch.bfloat16, bias=bias)
        half = k // 2
        one = gt.GemmConfig(16, 16, 16, 2, 4, 2, 1, tma)
        monkeypatch.setattr(gt, "gemm_config", lambda *_, c=one: c)
        parts = [
            gt.linear_triton(
                x[:, s * half : (s + 1) * half], w[:, s * half : (s + 1) * half], None, torch.float32
            )
            for s in (0, 1)
        ]
        acc = parts[0] + parts[1]
        acc = acc if b is None else acc + b.float()
        outs = []
        for programs in (False, True):
            cfg = dataclasses.replace(one, k_split=2, split_programs=programs)
            monkeypatch.setattr(gt, "gemm_config", lambda *_, c=cfg: c)
            outs.append([gt.linear_triton(x, w, b, dt) for dt in (torch.float32, torch.bfloat16)])
        assert torch.equal(outs[0][0], acc) and torch.equal(outs[1][0], acc), (m, n, k)
        # bf16: the interpreter rounds fp32 -> bf16 its own way (not torch's), so kernel against kernel
        assert torch.equal(outs[0][1], outs[1][1]), (m, n, k)
        torch.testing.assert_close(acc.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_split_programs_rows_invariant_interpreted(interp_runs, monkeypatch):
    """Split programs (one bucket) and one program per tile (the next) give every row the same bits,
    whatever M and the rows around it."""
    gt = interp_runs
    cfgs = [gt.GemmConfig(16, 16, 16, 2, 4, 2, 1, False, False, 2, programs) for programs in (True, False)]
    monkeypatch.setattr(gt, "gemm_config", lambda n, k, dtype, m=1, device=None: cfgs[0] if m <= 20 else cfgs[1])
    x, w, b = _inputs(45, 40, 96, torch.bfloat16)
    full = gt.linear_triton(x, w, b, torch.bfloat16)
    for start, size in ((0, 1), (3, 17), (20, 20), (0, 21), (30, 15)):
        assert torch.equal(
            gt.linear_triton(x[start : start + size], w, b, torch.bfloat16), full[start : start + size]
        )


def test_tuned_table_refuses_a_reduction_that_follows_m(interp):
    gt, C = interp, interp.GemmConfig
    good = {
        (_BF16, 64, 128): (
            (16, C(16, 16, 32, 8, 4, 2, 1, False, False, 2, True)),
            (None, C(64, 64, 32, 8, 4, 2, 1, False, False, 2)),
        )
    }
    gt.check_tuned(good)
    for bad in (
        (
            (16, C(16, 16, 32, 8, 4, 2, 1, False, False, 2, True)),
            (None, C(64, 64, 32, 8, 4, 2)),
        ),  # k_split by M
        ((16, C(16, 16, 16, 8, 4, 2)), (None, C(64, 64, 32, 8, 4, 2))),  # BLOCK_K by M
        ((None, C(64, 64, 32, 8, 4, 2, 1, False, False, 2, True)),),  # split programs without a bound
        ((None, C(64, 64, 48, 8, 4, 2, 1, False, False, 2)),),  # a part of 64 is not whole BLOCK_K steps
        (
            (16, C(16, 16, 32, 8, 4, 2, 1, False, False, 1, True)),
            (None, C(64, 64, 32, 8, 4, 2)),
        ),  # programs, one part
    ):
        with pytest.raises(AssertionError):
            gt.check_tuned({(_BF16, 64, 128): bad})


def test_device_tiles_replace_tiles_only(interp, monkeypatch):
    """A card's own tiles (`_TUNED_ON`) replace a bucket's tile and nothing else: the same k_split and
    bounds (another BLOCK_K only for bf16, where the GPU chains the same k = 16 MMAs); the card is told
    by its name, other cards keep `_TUNED`'s tiles."""
    gt, C = interp, interp.GemmConfig
    tuned = {
        (_BF16, 64, 128): ((16, C(16, 16, 32, 8, 4, 2)), (None, C(64, 64, 32, 8, 4, 2))),
        (torch.float32, 64, 128): ((None, C(64, 64, 32, 8, 4, 2)),),
        (_BF16, 64, 192): ((None, C(64, 64, 32, 8, 4, 2, 1, False, False, 2)),),
    }
    gt.check_tiles_on({"X1": {(_BF16, 64, 128): {16: C(16, 32, 32, 8, 4, 6, 2), None: C(64, 64, 128, 8, 4, 2)}}}, tuned)
    for bad in (
        {(_BF16, 64, 128): {None: C(64, 64, 32, 8, 4, 2, 1, False, False, 2)}},  # another k_split
        {(_BF16, 64, 128): {32: C(16, 32, 32, 8, 4, 6)}},  # a bound the shape does not have
        {(_BF16, 64, 256): {16: C(16, 32, 32, 8, 4, 6)}},  # a shape _TUNED does not have
        {(torch.float32, 64, 128): {None: C(64, 64, 16, 8, 4, 2)}},  # another BLOCK_K for fp32
        {(_BF16, 64, 192): {None: C(64, 64, 64, 8, 4, 2, 1, False, False, 2)}},  # parts of 96 in steps of 64
    ):
        with pytest.raises(AssertionError):
            gt.check_tiles_on({"X1": bad}, tuned)
    assert gt.tiles_for_device_name("NVIDIA H200") is gt._TUNED_ON["H200"]
    assert gt.tiles_for_device_name("NVIDIA H100 80GB HBM3") == {}
    cpu = torch.device("cpu")
    assert gt._tiles_on(cpu) == {}
    for (dtype, n, k), by_bound in gt._TUNED_ON["H200"].items():
        monkeypatch.setattr(gt, "_tiles_on", lambda device: gt._TUNED_ON["H200"])
        for bound, _ in gt._TUNED[(dtype, n, k)]:
            m = 100_000 if bound is None else bound  # the bucket's largest M
            base = gt.gemm_config(n, k, dtype, m)
            mine = gt.gemm_config(n, k, dtype, m, cpu)
            assert mine == by_bound.get(bound, base), (n, k, bound)
            assert mine.k_split == base.k_split
        monkeypatch.undo()
    # a _TUNED patched after the import check (two K parts) under a card's one-part tile: refused
    (dtype, n, k), by_bound = next(iter(gt._TUNED_ON["H200"].items()))
    bound = next(iter(by_bound))
    monkeypatch.setattr(gt, "_tiles_on", lambda device: gt._TUNED_ON["H200"])
    split = dataclasses.replace(by_bound[bound], k_split=2)
    monkeypatch.setitem(gt._TUNED, (dtype, n, k), ((bound, split), (None, dataclasses.replace(split, block_m=128))))
    with pytest.raises(ValueError, match="splits K unlike"):
        gt.gemm_config(n, k, dtype, 1, cpu)


def test_reduction_depends_on_weight_shape_only(interp):
    """BLOCK_K (the reduction order) is one per (N, K, dtype); only the tile may follow M."""
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in ((4096, 2048), (12288, 2048), (2048, 6144), (1024, 4096), (151936, 2048), (300, 200)):
            configs = {
                m: interp.gemm_config(n, k, dtype, m)
                for m in (1, 63, 64, 65, 128, 129, 256, 257, 512, 513, 8192)
            }
            assert len({c.block_k for c in configs.values()}) == 1, (n, k, configs)
            for cfg in configs.values():
                assert cfg.block_m in (16, 32, 64, 128, 256) and cfg.block_n >= 16 and cfg.block_k >= 16
    for key, buckets in interp._TUNED.items():
        assert len({cfg.block_k for _, cfg in buckets}) == 1, key
        bounds = [bound for bound, _ in buckets]
        assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), key


# ----------------------------------------------------------------------------- CUDA


QWEN3_SHAPES = [  # (N, K, bias, out_dtype): 1.7B qkv (+ a Qwen2-style bias), o, gate_up, down, lm_head
    (4096, 2048, True, torch.bfloat16),
    (2048, 2048, False, torch.bfloat16),
    (12288, 2048, False, torch.bfloat16),
    (2048, 6144, False, torch.bfloat16),
    (151936, 2048, False, torch.float32),
]
QWEN3_8B_SHAPES = [(6144, 4096, False, torch.bfloat16), (4096, 4096, False, torch.bfloat16),
                   (24576, 4096, False, torch.bfloat16), (4096, 12288, False, torch.bfloat16),
                   (151936, 4096, False, torch.float32)]  # fmt: skip


@pytest.mark.parametrize("n,k,bias,out_dtype", QWEN3_SHAPES + QWEN3_8B_SHAPES)
@pytest.mark.cuda
@needs_cuda
def test_rows_invariant_across_tile_buckets_cuda(monkeypatch, n, k, bias, out_dtype):
    """Rows of an M = 1100 call (the last bucket's tile) equal every smaller call's (each bucket's
    tile, on both sides of every boundary), and all tiles of a tuned shape give the same bits on the
    same rows."""
    import vexact_vllm.kernels.gemm.linear_triton as gt

    x, w, b = _inputs(1100, n, k, torch.bfloat16, device="cuda", bias=bias)
    full = gt.linear_triton(x, w, b, out_dtype)
    buckets = gt._TUNED.get((torch.bfloat16, n, k), ())
    edges = {e for bound, _ in buckets if bound is not None for e in (bound, bound + 1)}
    for m in sorted({1, 2, 7, 300, 777, 1024, 1099} | edges):
        assert torch.equal(gt.linear_triton(x[:m], w, b, out_dtype), full[:m]), m
    for start, size in ((3, 500), (400, 700), (1000, 100)):
        assert torch.equal(
            gt.linear_triton(x[start : start + size], w, b, out_dtype), full[start : start + size]
        )
    on_cards = [cfg for tiles in gt._TUNED_ON.values() for cfg in tiles.get((torch.bfloat16, n, k), {}).values()]
    for cfg in [cfg for _, cfg in buckets] + on_cards:  # every card's tiles, whichever card this is
        monkeypatch.setattr(gt, "gemm_config", lambda *_, cfg=cfg: cfg)
        assert torch.equal(gt.linear_triton(x, w, b, out_dtype), full), cfg


@pytest.mark.parametrize("n,k,bias,out_dtype", QWEN3_SHAPES)
@pytest.mark.cuda
@needs_cuda
def test_tma_kernel_equals_pointer_kernel_cuda(monkeypatch, n, k, bias, out_dtype):
    """The TMA variant of a tile (with and without warp specialization) gives the pointer kernel's bits."""
    import vexact_vllm.kernels.gemm.linear_triton as gt

    x, w, b = _inputs(700, n, k, torch.bfloat16, device="cuda", bias=bias)
    block_k = gt.gemm_config(n, k, torch.bfloat16, 1).block_k
    for tile in ((64, 64), (128, 128)):
        outs = []
        for tma, ws in ((False, False), (True, False), (True, True)):
            cfg = gt.GemmConfig(*tile, block_k, 8, 4, 3, 1, tma, ws)
            monkeypatch.setattr(gt, "gemm_config", lambda *_, cfg=cfg: cfg)
            outs.append([gt.linear_triton(x[:m], w, b, out_dtype) for m in (1, 256, 700)])
        for other in outs[1:]:
            assert all(torch.equal(a, c) for a, c in zip(outs[0], other)), tile


@pytest.mark.parametrize(
    "n,k,bias",
    [(4096, 2048, True), (2048, 2048, False), (2048, 6144, False), (4096, 4096, False), (1000, 1280, True)],
)
@pytest.mark.cuda
@needs_cuda
def test_k_split_is_the_sum_of_two_halves_cuda(monkeypatch, n, k, bias):
    """k_split = 2 on the GPU: every way of computing it (two programs meeting through the tickets,
    one program with pointer or TMA loads, with warp specialization) gives (p_0 + p_1 + b).to(out),
    p_s the one-part kernel on K half s, for both output dtypes."""
    import vexact_vllm.kernels.gemm.linear_triton as gt

    x, w, b = _inputs(4100, n, k, torch.bfloat16, device="cuda", bias=bias)
    block_k = gt.gemm_config(n, k, torch.bfloat16, 1).block_k
    half = k // 2
    one = gt.GemmConfig(64, 64, block_k, 8, 4, 3)
    monkeypatch.setattr(gt, "gemm_config", lambda *_, c=one: c)
    acc = sum(
        gt.linear_triton(
            x[:, s * half : (s + 1) * half], w[:, s * half : (s + 1) * half], None, torch.float32
        )
        for s in (0, 1)
    )
    acc = acc if b is None else acc + b.float()
    ways = [
        gt.GemmConfig(64, 16, block_k, 8, 4, 4, 1, False, False, 2, True),
        gt.GemmConfig(64, 64, block_k, 8, 4, 3, 1, False, False, 2, True),
        gt.GemmConfig(64, 32, block_k, 8, 4, 4, 3, False, False, 2),
        gt.GemmConfig(128, 128, block_k, 8, 8, 2 if block_k > 64 else 3, 1, True, False, 2),
        gt.GemmConfig(64, 128, block_k, 8, 4, 3 if block_k > 64 else 4, 1, True, True, 2),
    ]
    for cfg in ways:
        monkeypatch.setattr(gt, "gemm_config", lambda *_, c=cfg: c)
        for m in (1, 16, 100, 700, 4100):  # 4100: several tiles per persistent program
            if cfg.split_programs and m > 700:
                continue  # decode-size path (bounded M buckets)
            for out_dtype in (torch.float32, torch.bfloat16):
                got = gt.linear_triton(x[:m], w, b, out_dtype)
                assert torch.equal(got, acc[:m].to(out_dtype)), (cfg, m, out_dtype)


@pytest.mark.parametrize("n,k,bias,out_dtype", QWEN3_SHAPES)
@pytest.mark.cuda
@needs_cuda
def test_rows_invariant_cuda(n, k, bias, out_dtype):
    from vexact_vllm.kernels.gemm.linear_triton import linear_triton

    x, w, b = _inputs(300, n, k, torch.bfloat16, device="cuda", bias=bias)
    full = linear_triton(x, w, b, out_dtype)
    for m in range(1, 301):
        assert torch.equal(linear_triton(x[:m], w, b, out_dtype), full[:m]), m
    for start, size in ((1, 7), (63, 65), (129, 128), (200, 100), (299, 1)):
        part = linear_triton(x[start : start + size], w, b, out_dtype)
        assert torch.equal(part, full[start : start + size]), (start, size)
    x_wide = torch.zeros(300, k + 64, dtype=x.dtype, device="cuda")
    x_wide[:, 64:] = x
    assert torch.equal(linear_triton(x_wide[:, 64:], w, b, out_dtype), full)


@pytest.mark.parametrize("n,k,bias,out_dtype", [(4096, 4096, False, _BF16), (2048, 6144, True, torch.float32),
                                                 (1000, 1280, True, _BF16)])  # fmt: skip
@pytest.mark.cuda
@needs_cuda
def test_block_k_does_not_change_bits_cuda(monkeypatch, n, k, bias, out_dtype):
    """On the GPU a bf16 `tl.dot` over BLOCK_K columns is BLOCK_K / 16 tensor-core MMAs of k = 16
    chained on the fp32 accumulator in K order, so BLOCK_K only groups the chain: every BLOCK_K from
    16 to 256, pointer or TMA loads, any tile, gives BLOCK_K = 64's bits (found on an H200,
    2026-11-28: 352 of 352 configurations that fit). `_TUNED` still fixes one BLOCK_K per shape (the
    interpreter's dot is one numpy sum per BLOCK_K and does differ); this test is the evidence a
    decode tile needs before it takes another BLOCK_K than its shape's."""
    import vexact_vllm.kernels.gemm.linear_triton as gt

    x, w, b = _inputs(700, n, k, _BF16, device="cuda", bias=bias)
    ref_cfg = gt.GemmConfig(64, 64, 64, 8, 4, 3)
    monkeypatch.setattr(gt, "gemm_config", lambda *_, c=ref_cfg: c)
    ms = (1, 16, 128, 700)
    ref = {m: gt.linear_triton(x[:m], w, b, out_dtype) for m in ms}
    for block_k in (16, 32, 128, 256):
        for block_m, block_n, warps in ((64, 32, 4), (64, 64, 4), (128, 128, 8)):
            for tma in (False, True):
                cfg = gt.GemmConfig(block_m, block_n, block_k, 8, warps, 3 if block_k <= 128 else 2, 1, tma)
                if gt._smem_bytes(dataclasses.replace(cfg, num_stages=2), 2, out_dtype.itemsize) > gt._SMEM:
                    continue  # 128x128x256: no room for two stages (linear_triton drops stages to 2 at most)
                monkeypatch.setattr(gt, "gemm_config", lambda *_, c=cfg: c)
                for m in ms:
                    assert torch.equal(gt.linear_triton(x[:m], w, b, out_dtype), ref[m]), (cfg, m)


@pytest.mark.cuda
@needs_cuda
def test_sm_count_does_not_change_bits_cuda(monkeypatch):
    import vexact_vllm.kernels.gemm.linear_triton as gt

    x, w, b = _inputs(257, 2048, 2048, torch.bfloat16, device="cuda")
    full = gt.linear_triton(x, w, b, torch.bfloat16)
    for sms in (1, 7):
        monkeypatch.setattr(gt, "num_sms", lambda device, sms=sms: sms)
        assert torch.equal(gt.linear_triton(x, w, b, torch.bfloat16), full), sms


@pytest.mark.cuda
@needs_cuda
def test_every_config_fits_and_is_accurate_cuda():
    """Each tuned entry and each default rule compiles (shared memory included) for both outputs."""
    import vexact_vllm.kernels.gemm.linear_triton as gt

    untuned = [(_BF16, 65536, 1024), (_BF16, 3072, 1024), (_BF16, 512, 1024), (torch.float32, 300, 200)]
    for dtype, n, k in [*gt._TUNED, *untuned]:
        bounds = [bound for bound, _ in gt._TUNED.get((dtype, n, k), ()) if bound is not None]
        for m in sorted({3, *(bound - 1 for bound in bounds), 1100}):  # every tile of a tuned shape
            x, w, b = _inputs(m, n, k, dtype, device="cuda")
            ref = _reference(x, w, b)
            for out_dtype in (torch.float32, torch.bfloat16):
                tol = TOL[out_dtype]
                torch.testing.assert_close(
                    gt.linear_triton(x, w, b, out_dtype).double(), ref, rtol=tol, atol=tol
                )
            del x, w, b, ref


@pytest.mark.parametrize(
    "m,n,k,dtype",
    [
        (300, 2048, 2048, torch.bfloat16),
        (257, 6144, 2048, torch.bfloat16),
        (5, 2048, 6144, torch.bfloat16),
        (129, 1000, 1000, torch.bfloat16),  # N and K tails
        (3, 151936, 2048, torch.bfloat16),
        (65, 1024, 4096, torch.bfloat16),
        (70, 200, 333, torch.float32),
        (257, 2048, 2048, torch.float32),
    ],
)
@pytest.mark.cuda
@needs_cuda
def test_accuracy_cuda(m, n, k, dtype):
    from vexact_vllm.kernels.gemm.linear_triton import linear_triton

    x, w, b = _inputs(m, n, k, dtype, device="cuda")
    ref = _reference(x, w, b)
    for out_dtype in (torch.float32, torch.bfloat16):
        y = linear_triton(x, w, b, out_dtype)
        assert y.dtype == out_dtype
        tol = TOL[out_dtype]
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "dtype,out_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
)
@pytest.mark.cuda
@needs_cuda
def test_gradients_cuda(dtype, out_dtype):
    """Through the autograd function `linear` dispatches CUDA tensors to: values against autograd of
    an fp32 reference, and bitwise repeatable (DESIGN rule 7)."""
    x, w, b = (t.requires_grad_() for t in _inputs(77, 1024, 2048, dtype, device="cuda"))
    g = torch.randn(77, 1024, device="cuda").to(out_dtype)

    def grads():
        for t in (x, w, b):
            t.grad = None
        (gemm._IMPLS["triton"](x, w, b, out_dtype) * g).sum().backward()
        return [t.grad.clone() for t in (x, w, b)]

    got = grads()
    assert all(a.dtype == dtype for a in got)
    assert all(torch.equal(a, c) for a, c in zip(got, grads()))
    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, b))
    ((xf @ wf.t() + bf) * g.float()).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, want in zip(got, (xf.grad, wf.grad, bf.grad)):
        torch.testing.assert_close(a.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_warmup_sizes_reach_every_bucket():
    """One M per tile bucket: warming up at these sizes compiles every variant a batch can launch."""
    gt = importlib.import_module(MODULE)
    for (dtype, n, k), buckets in gt._TUNED.items():
        sizes = gt.warmup_sizes(n, k, dtype)
        assert {gt.gemm_config(n, k, dtype, m) for m in sizes} == {cfg for _, cfg in buckets}
        assert len(sizes) == len(buckets)
    assert gt.warmup_sizes(40, 24, torch.bfloat16) == [1]  # an untuned shape: one tile for every M


@pytest.mark.parametrize("seed", range(4))
def test_shard_tiles_follow_the_output_area_and_warm_up_every_bucket(seed):
    """A column shard (tensor parallelism) of n of a tuned weight's N rows picks its tile at m n / N
    rows, keeps the whole shape's reduction in every bucket, and its warm-up sizes reach each bucket."""
    gt = importlib.import_module(MODULE)
    rng = random.Random(seed)
    (dtype, whole, k), buckets = rng.choice(list(gt._TUNED.items()))
    for tp in (2, 3, 4, 8):
        n = rng.choice([whole // tp, -(-whole // tp)])  # torch.tensor_split's blocks: the larger and the smaller
        sizes = gt.warmup_sizes(n, k, dtype, whole)
        tiles = [gt.gemm_config(whole, k, dtype, gt.tile_rows(m, n, whole)) for m in sizes]
        assert tiles == [cfg for _, cfg in buckets]
        for m in (1, rng.randint(2, 64), rng.randint(65, 4096)):
            rows = gt.tile_rows(m, n, whole)
            assert 1 <= rows <= m and (rows - 1) * whole < m * n <= rows * whole  # the least rows covering the area
    assert gt.tile_rows(37, 40, None) == 37 and gt.tile_rows(37, 40, 40) == 37


def test_warm_up_linear_is_a_no_op_off_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "linear", lambda *a, **k: calls.append(a))
    gemm.warm_up_linear(torch.zeros(8, 4, dtype=torch.bfloat16))
    assert calls == []


def test_launch_into_out_interpreted(small_tiles):
    """`launch_linear(..., out=)` (the lm_head's CUDA-graph output) writes the same bits into the
    given rows of a larger buffer and leaves the rest alone."""
    x, w, b = _inputs(5, 40, 24, torch.bfloat16)
    buf = torch.full((9, 40), 7.0)
    got = small_tiles.launch_linear(x, w, b, torch.float32, out=buf[:5])
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:5], small_tiles.linear_triton(x, w, b, torch.float32))
    assert torch.equal(buf[5:], torch.full((4, 40), 7.0))


@pytest.mark.parametrize("variant", ["pointer", "tma", "split"])
def test_launch_into_a_column_block_interpreted(small_tiles, monkeypatch, variant):
    """`out=` a column block of a wider matrix (rows further apart: a tensor-parallel exchange
    buffer): the same bits as a fresh output, every other column untouched; pointer loads, TMA and
    the split-K programs."""
    rng = random.Random(variant)
    m, n, k = rng.randint(1, 9), rng.choice([16, 24, 40]), 32
    if variant != "pointer":
        cfg = small_tiles.GemmConfig(16, 16, 16, 2, 4, 2, tma=variant == "tma", k_split=1 + (variant == "split"),
                                     split_programs=variant == "split")  # fmt: skip
        monkeypatch.setattr(small_tiles, "gemm_config", lambda *_: cfg)
    x, w, b = _inputs(m, n, k, torch.bfloat16)
    want = small_tiles.linear_triton(x, w, b, torch.bfloat16)
    start = rng.choice([8, 16])
    wide = torch.full((m, start + n + 8), -0.0, dtype=torch.bfloat16)
    small_tiles.launch_linear(x, w, b, torch.bfloat16, out=wide[:, start : start + n])
    assert torch.equal(wide[:, start : start + n], want)
    rest = torch.cat([wide[:, :start], wide[:, start + n :]], 1)
    assert torch.equal(rest.view(torch.int16), torch.full_like(rest, -0.0).view(torch.int16))  # still -0.0
    through = torch.full_like(wide, -0.0)
    got = gemm.linear(x, w, b, out=through[:, start : start + n])  # linear() takes the block too (its backend)
    assert torch.equal(got, gemm.linear(x, w, b)) and got.data_ptr() == through[:, start:].data_ptr()
