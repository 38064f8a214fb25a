"""Split-K GEMMs inside CUDA graphs captured the way vLLM captures them (CUDA only).

vLLM captures one graph per batch size, largest first, on a capture stream, all in one memory pool,
and replays them on its serving stream. Memory a launch allocates during capture lies in that pool,
where the other graphs' activations come and go; the split kernel's tickets once lived there and
were overwritten (the prefix-cache failure of 2026-11-24). Here the pool is churned with NaN between
and inside graphs, and every replay must equal the sum of the two K halves bit for bit.
"""

import random

import pytest
import torch

from vexact_vllm.kernels.capture import gc_paused

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _split_table(gt, block_k):
    """Buckets reaching every split path: two programs per tile (two tile shapes), one program
    with pointer loads, one with TMA."""
    c = gt.GemmConfig
    return (
        (64, c(64, 32, block_k, 8, 4, 3, 1, False, False, 2, True)),
        (128, c(64, 64, block_k, 8, 4, 4, 1, False, False, 2, True)),
        (256, c(64, 64, block_k, 8, 4, 4, 1, False, False, 2)),
        (None, c(64, 128, block_k, 8, 4, 4, 1, True, False, 2)),
    )


@pytest.mark.parametrize("n,k", [(2048, 6144), (1024, 2048)])
@pytest.mark.cuda
@needs_cuda
def test_split_gemm_in_vllm_style_cuda_graphs(monkeypatch, n, k):
    import vexact_vllm.kernels.gemm.linear_triton as gt

    block_k = 128 if k >= 3 * n else 64
    monkeypatch.setitem(gt._TUNED, (torch.bfloat16, n, k), _split_table(gt, block_k))
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(2048, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    one = gt.GemmConfig(64, 64, block_k, 8, 4, 3)
    with monkeypatch.context() as m:
        m.setattr(gt, "gemm_config", lambda *_: one)
        h = k // 2
        ref = sum(gt.linear_triton(x[:, s * h : (s + 1) * h], w[:, s * h : (s + 1) * h], None, torch.float32) for s in (0, 1))
    ref = ref.bfloat16()

    sizes = [512, 384, 256, 136, 128, 96, 64, 16, 8, 1]  # largest first, as vLLM captures
    inp = torch.zeros(max(sizes), k, device="cuda", dtype=torch.bfloat16)  # the runner's static input

    def forward(s):
        a = inp[:s] * 1.0  # an activation of the pool
        torch.empty(s, 4 * k, device="cuda", dtype=torch.bfloat16).fill_(float("nan"))  # churn, freed
        y = gt.linear_triton(a, w, None, torch.bfloat16)
        torch.empty(s, 2 * n, device="cuda", dtype=torch.float32).fill_(float("nan"))
        return y * 1.0

    serving = torch.cuda.Stream()
    with torch.cuda.stream(serving):
        for s in sizes:
            forward(s)  # warm-up (compiles) on another stream than the capture's
    torch.cuda.synchronize()
    pool, capture = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    graphs, outs = {}, {}
    for s in sizes:
        graphs[s] = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(graphs[s], pool=pool, stream=capture):
            outs[s] = forward(s)

    rng = random.Random(k)
    with torch.cuda.stream(serving):
        for t in range(300):
            s = rng.choice(sizes)
            m = rng.randint(max(1, s // 2), s)  # the real rows; the rest is padding
            rows = torch.randint(0, x.shape[0], (s,), device="cuda", generator=gen)
            inp[:s].copy_(x[rows])
            graphs[s].replay()
            if t % 5 == 0:  # an eager launch between replays
                gt.linear_triton(x[: rng.randint(1, 600)], w, None, torch.bfloat16)
            assert torch.equal(outs[s][:m], ref[rows][:m]), (t, s, m, gt.gemm_config(n, k, torch.bfloat16, s))
