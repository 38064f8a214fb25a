"""The linear forward's CuTe-DSL path on Hopper (`kernels/gemm/linear_cute.py`): its choice of
configuration and of launches on the CPU, and on an SM90 GPU the Triton kernel's bits from every
configuration it can pick (`torch.equal`), at random shapes, rows of zeros, with a bias, fp32 output,
a column block of a wider output and under CUDA-graph replay."""

import random

import pytest
import torch

from vexact_vllm.kernels.gemm import linear_cute as lc

SMS = 132


@pytest.mark.parametrize("n", [8, 64, 1000, 2048, 2560, 4096, 12352, 18432, 151936, 248320])
def test_decode_rows_take_the_swapped_narrow_tile(n):
    assert all(lc.cute_config(m, n, SMS) == lc.SWAP_128x64 for m in range(1, lc.DECODE_ROWS + 1))


def test_larger_batches_take_the_widest_tile_that_fills_half_the_sms():
    # the picks the H200 timings gave (Qwen3.5-4B shapes): N 2560 at 256 and 512 rows, N 12352 at 256
    assert lc.cute_config(256, 2560, SMS) == lc.SWAP_128x64
    assert lc.cute_config(512, 2560, SMS) == lc.SWAP_128x128
    assert lc.cute_config(1024, 2560, SMS) == lc.WIDE_128x192
    assert lc.cute_config(256, 12352, SMS) == lc.WIDE_128x192
    rng = random.Random(0)
    for _ in range(2000):
        m, n, sms = rng.randint(lc.DECODE_ROWS + 1, 20000), rng.randint(1, 300000), rng.choice([1, 66, 78, 132])
        cfg = lc.cute_config(m, n, sms)
        order = (lc.WIDE_128x192, lc.SWAP_128x128, lc.SWAP_128x64)
        wider = order[: order.index(cfg)]
        assert all(lc._tiles(m, n, c) * 2 < sms for c in wider), (m, n, sms, cfg)  # no wider tile fills half
        assert cfg == lc.SWAP_128x64 or lc._tiles(m, n, cfg) * 2 >= sms


def test_tile_counts():
    assert lc._tiles(256, 2560, lc.SWAP_128x64) == 20 * 4  # weight rows on tile_m, batch rows on tile_n
    assert lc._tiles(256, 2560, lc.WIDE_128x192) == 2 * 14


@pytest.mark.parametrize("sms", [1, 66, 132])
def test_warmup_rows_reach_every_configuration(sms):
    rng = random.Random(sms)
    for n in [1, 8, 100, 2048, 2560, 12352, 248320] + [rng.randint(1, 100000) for _ in range(30)]:
        rows = lc.warmup_rows(n, sms)
        warmed = {lc.cute_config(m, n, sms) for m in rows}
        assert len(warmed) == len(rows)  # one row per configuration
        reached = {lc.cute_config(m, n, sms) for m in list(range(1, 3000)) + [rng.randint(1, 1 << 16) for _ in range(300)]}
        assert reached <= warmed, (n, sms)


def test_warmup_sizes_add_the_cute_rows_to_untuned_shapes_only():
    from vexact_vllm.kernels.gemm.linear_triton import _TUNED, warmup_sizes

    bf16 = torch.bfloat16
    assert warmup_sizes(2560, 9216, bf16) == [1]  # no device: the Triton kernel's one tile
    assert warmup_sizes(2560, 9216, bf16, sms=SMS) == sorted({1, *lc.warmup_rows(2560, SMS)})
    tuned = (4096, 4096)
    assert warmup_sizes(*tuned, bf16, sms=SMS) == warmup_sizes(*tuned, bf16)
    split = next(key for key, buckets in _TUNED.items() if buckets[0][1].k_split == 2)
    assert warmup_sizes(split[1] // 2, split[2], bf16, config_n=split[1], sms=SMS) == warmup_sizes(
        split[1] // 2, split[2], bf16, config_n=split[1])  # a K split: never the CuTe-DSL path


def test_alignment_rule():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert lc.aligned(x)
    assert not lc.aligned(torch.zeros(4, 12, dtype=torch.bfloat16))  # 24-byte rows
    assert not lc.aligned(x[:, 1:])  # base off by 2 bytes
    assert lc.aligned(x[:, 8:])  # a column block 16 bytes in
    assert not lc.aligned(x.t())


def test_strided_operands_keep_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(lc, "_hopper", lambda device: True)  # as if on an SM90 device, quack installed
    monkeypatch.setattr(lc, "_quack", lambda: object())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    wide, w = torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    y = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert lc.takes(wide[:, :64].contiguous(), w, None, y)
    assert not lc.takes(wide[:, :64], w, None, y)  # rows 256 bytes apart for 128-byte rows
    assert not lc.takes(wide[:, :64].contiguous(), torch.zeros(32, 128, dtype=torch.bfloat16)[:, 64:], None, y)
    assert not lc.takes(wide[:, :64].contiguous().float(), w.float(), None, y.float())  # fp32 operands: TF32
    assert not lc.takes(wide[:, :64].contiguous(), w, torch.zeros(32), y)  # an fp32 bias with bf16 operands


def test_cpu_tensors_never_take_the_path():
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not lc.takes(x, w, None, torch.zeros(4, 32, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- CUDA

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an SM90 GPU"
)


def _triton(monkeypatch, x, w, b, out_dtype, out=None):
    """The Triton kernel's result (the CuTe-DSL path turned away for this call)."""
    from vexact_vllm.kernels.gemm.linear_triton import launch_linear

    with monkeypatch.context() as m:
        m.setattr(lc, "takes", lambda *args: False)
        return launch_linear(x, w, b, out_dtype, out=out)


@pytest.mark.cuda
@needs_hopper
def test_every_configuration_gives_the_triton_kernels_bits_cuda(monkeypatch):
    assert lc._quack() is not None, "quack-kernels is not installed: pip install -e '.[gpu]'"
    from vexact_vllm.kernels.gemm.linear_triton import launch_linear, num_sms

    rng = random.Random(7)
    sms = num_sms(torch.device("cuda"))
    for _ in range(60):
        n, k, m = rng.choice([8, 24, 136, 1000, 2056, 2560, 12352]), 8 * rng.randint(1, 1200), rng.randint(1, 2500)
        out_dtype = rng.choice([torch.bfloat16, torch.float32])
        x = torch.randn(m, k, device="cuda").bfloat16()
        x[rng.randrange(m)] = 0  # a row of zeros
        w = (torch.randn(n, k, device="cuda") * rng.choice([0.02, 1.0])).bfloat16()
        b = torch.randn(n, device="cuda").bfloat16() if rng.random() < 0.3 else None
        ref = _triton(monkeypatch, x, w, b, out_dtype)
        assert lc.takes(x, w, b, ref)
        got = launch_linear(x, w, b, out_dtype)  # the path's own pick
        assert torch.equal(got, ref), (m, n, k, out_dtype, lc.cute_config(m, n, sms))
        for cfg in lc.CONFIGS:
            y = torch.empty_like(ref)
            lc.launch(x, w, b, y, sms, cfg)
            assert torch.equal(y, ref), (m, n, k, out_dtype, cfg)


@pytest.mark.cuda
@needs_hopper
def test_column_block_of_a_wider_output_and_graph_replay_cuda(monkeypatch):
    from vexact_vllm.kernels.gemm.linear_triton import launch_linear

    w = (torch.randn(2560, 4096, device="cuda") * 0.02).bfloat16()
    for m in (3, 200, 700):
        x = torch.randn(m, 4096, device="cuda").bfloat16()
        ref = _triton(monkeypatch, x, w, None, torch.bfloat16)
        wide = torch.full((m, 8192), -0.0, dtype=torch.bfloat16, device="cuda")
        launch_linear(x, w, None, torch.bfloat16, out=wide[:, 1024 : 1024 + 2560])
        assert torch.equal(wide[:, 1024:3584], ref)
        rest = torch.cat([wide[:, :1024], wide[:, 3584:]], 1)
        assert bool((rest.view(torch.int16) == -32768).all())  # the -0.0 around the block untouched
        y = torch.empty_like(ref)
        launch_linear(x, w, None, torch.bfloat16, out=y)  # compile before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch_linear(x, w, None, torch.bfloat16, out=y)
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ref), m
