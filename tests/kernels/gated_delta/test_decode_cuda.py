"""The decode step's CUDA kernels (`incremental_decode_cuda.py`) against the Triton kernels they replace:
`decode_weights` against `_decode_weights_kernel` (every scratch row and slot row it writes), then the whole
step (`decode_forward` with and without them: every output row and cache tensor), bit for bit, at random
chunk positions, head counts, states and slot contents, padded requests and fresh sequences included. Needs
CUDA; the decode == prefill contract through them is `test_incremental_triton.py`'s CUDA tests."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vexact_vllm.kernels.gated_delta import incremental_cache as layout
from vexact_vllm.kernels.gated_delta import incremental_decode_cuda as cuda_weights
from vexact_vllm.kernels.gated_delta import incremental_decode_triton as triton_decode

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
D = 128


def test_the_cuda_source_ships_with_the_package():
    """The .cu file the launcher compiles sits beside it and is package data (a wheel carries it), with
    both kernels the launcher names."""
    import tomllib

    root = Path(__file__).resolve().parents[3]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.cu" in data["vexact_vllm.kernels.gated_delta"]
    source = cuda_weights.SOURCE.read_text()
    for name in ("decode_weights", "decode_values"):
        assert f"__global__ void __launch_bounds__(32 * WARPS) {name}(" in source
    assert f"#define WARPS {cuda_weights.WARPS}" in source and f"#define BV {cuda_weights.BV}" in source


def _random_case(hk, hv, n, seed):
    """(prepared q_hat, k_hat, g, beta, a cache with random rows, start, held, slots) on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    n_slots, n_rows = n + 3, n + 5
    cache = layout.IncrementalCache.empty(n_slots, hk, hv, D, D, torch.bfloat16, "cuda")
    cache.k.copy_(F.normalize(torch.randn(cache.k.shape, generator=gen), dim=-1).bfloat16())
    cache.g.copy_(-torch.rand(cache.g.shape, generator=gen) * torch.rand(1, generator=gen) * 2)
    cache.beta.copy_(torch.rand(cache.beta.shape, generator=gen).bfloat16().float())
    cache.t.copy_(torch.randn(cache.t.shape, generator=gen) * 0.5)
    q_hat = (F.normalize(torch.randn(n_rows, hk, D, generator=gen), dim=-1) * D**-0.5).bfloat16().cuda()
    k_hat = F.normalize(torch.randn(n_rows, hk, D, generator=gen), dim=-1).bfloat16().cuda()
    g = (-torch.rand(n_rows, hv, generator=gen)).cuda()
    beta = torch.rand(n_rows, hv, generator=gen).bfloat16().float().cuda()
    start = torch.randperm(n_rows, generator=gen)[:n].cuda()
    held = torch.randint(0, layout.CHUNK, (n,), generator=gen)
    held[:6] = torch.tensor([0, 1, 15, 16, 47, layout.CHUNK - 1])  # tile edges and the completing row
    slots = torch.randperm(n_slots, generator=gen)[:n]
    slots[5::7] = -1  # padded requests
    return q_hat, k_hat, g, beta, cache, start, held.cuda(), slots.cuda()


def _scratch(n, hv):
    """Scratch rows (t, w, p, qg) filled with a marker, so rows left unwritten compare too."""
    bf = dict(dtype=torch.bfloat16, device="cuda")
    return (torch.full((n, hv, layout.CHUNK), 7.0, device="cuda"), torch.full((n, hv, D), 7.0, **bf),
            torch.full((n, hv, layout.CHUNK), 7.0, **bf), torch.full((n, hv, D), 7.0, **bf))  # fmt: skip


def _first_difference(name, got, want, held):
    bad = (got != want).nonzero()
    where = tuple(bad[0].tolist())
    extra = f", held {int(held[where[0]])}" if name in ("t_row", "w_row", "p_row", "qg_row") else ""
    return f"{name}: {bad.shape[0]} of {got.numel()} differ, first at {where}{extra}: {got[where]} vs {want[where]}"


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv,n,seed", [(16, 32, 45, 0), (16, 48, 29, 1), (2, 6, 70, 2), (4, 4, 64, 3)])
def test_cuda_weights_kernel_matches_the_triton_kernel(hk, hv, n, seed):
    q_hat, k_hat, g, beta, cache, start, held, slots = _random_case(hk, hv, n, seed)
    assert cuda_weights.supported(q_hat, D)
    ours = layout.IncrementalCache(*(t.clone() for t in cache.tensors()))
    want, got = _scratch(n, hv), _scratch(n, hv)
    triton_decode.decode_weights_triton(q_hat, k_hat, g, beta, cache, start, held, slots, want)
    cuda_weights.decode_weights(q_hat, k_hat, g, beta, ours, start, held, slots, got)
    names = ("t_row", "w_row", "p_row", "qg_row")
    diffs = [_first_difference(m, a, b, held) for m, a, b in zip(names, got, want) if not torch.equal(a, b)]
    for m in ("k", "g", "beta", "t"):
        a, b = getattr(ours, m), getattr(cache, m)
        if not torch.equal(a, b):
            diffs.append(_first_difference(f"cache.{m}", a, b, held))
    assert not diffs, "; ".join(diffs)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv,n,seed", [(16, 32, 45, 4), (16, 48, 29, 5), (2, 6, 70, 6)])
def test_cuda_decode_step_matches_the_triton_step(hk, hv, n, seed, monkeypatch):
    """decode_forward with the CUDA kernels against the Triton kernels: every output row and every cache
    tensor, random states and slot rows, rows that complete their chunk (the state update) and sequences
    that start at the step (no state read) among them."""
    gen = torch.Generator().manual_seed(seed)
    _, _, _, _, cache, start, held, slots = _random_case(hk, hv, n, seed)
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen) * 0.3)
    cache.x.copy_((torch.randn(cache.x.shape, generator=gen) * 0.5).bfloat16())
    cache.vnew.copy_((torch.randn(cache.vnew.shape, generator=gen) * 0.5).bfloat16())
    n_rows = start.max().item() + 1
    q, k = (torch.randn(n_rows, hk, D, generator=gen).bfloat16().cuda() for _ in range(2))
    v = torch.randn(n_rows, hv, D, generator=gen).bfloat16().cuda()
    a, b = (torch.randn(n_rows, hv, generator=gen).bfloat16().cuda() for _ in range(2))
    A_log = torch.log(torch.rand(hv, generator=gen) * 1.99 + 0.01).cuda()
    dt_bias = (torch.randn(hv, generator=gen) * 0.5).cuda()
    read = torch.where(held > 0, slots, -1)
    read[1::5] = -1  # sequences that start here (no rows held, a zero state)
    held = torch.where(read < 0, 0, held)
    results = []
    for cuda in (False, True):
        monkeypatch.setattr(cuda_weights, "supported", lambda q_hat, d_v, cuda=cuda: cuda)
        ours = layout.IncrementalCache(*(t.clone() for t in cache.tensors()))
        out = torch.full((n_rows, hv, D), 7.0, dtype=torch.bfloat16, device="cuda")
        triton_decode.decode_forward(q, k, v, a, b, A_log, dt_bias, out, ours, start, held, slots, read)
        results.append((out, ours))
    (want, want_cache), (got, got_cache) = results
    diffs = [] if torch.equal(got, want) else [_first_difference("out", got, want, held)]
    for m in ("state", "k", "x", "g", "beta", "t", "vnew"):
        x, y = getattr(got_cache, m), getattr(want_cache, m)
        if not torch.equal(x, y):
            diffs.append(_first_difference(f"cache.{m}", x, y, held))
    assert not diffs, "; ".join(diffs)
