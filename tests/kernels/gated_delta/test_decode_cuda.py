"""The decode step's CUDA kernels (`incremental_decode_cuda.py`) against the Triton kernels they replace:
`decode_weights` against `_decode_weights_kernel` (every scratch row and slot row it writes), then the whole
step (`decode_forward` with and without them: every output row and cache tensor), bit for bit, at random
chunk positions, head counts, states and slot contents, padded requests and fresh sequences included (CUDA;
the decode == prefill contract through them is `test_incremental_triton.py`'s CUDA tests). On the CPU the
same kernels run compiled by g++ with warps emulated (simt_host.h: close to the GPU's values, not its bits)
against the interpreted Triton step: the indexing, the MMA fragments and the algorithm."""

import ctypes
import shutil
import subprocess
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
    the three kernels the launcher names, at the launcher's tile widths."""
    import tomllib

    root = Path(__file__).resolve().parents[3]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.cu" in data["vexact_vllm.kernels.gated_delta"]
    source = cuda_weights.SOURCE.read_text()
    assert "__global__ void __launch_bounds__(32 * WWARPS) decode_weights(" in source
    assert "__global__ void __launch_bounds__(32 * VWARPS) decode_values(" in source
    assert "__global__ void __launch_bounds__(32 * CWARPS) decode_commit(" in source
    for name in ("WWARPS", "WV", "BV", "BC", "CSEQ"):
        assert f"#define {name} {getattr(cuda_weights, name)} " in source


def test_commit_blocks_look_at_few_sequences_unless_the_grid_would_pass_a_wave():
    """decode_commit's sequences a block: one while the grid fits a wave (every completing sequence's work in
    a block of its own), doubling up to CSEQ past it; the grid covers every sequence."""
    for sms in (1, 7, 132):
        for hv in (1, 4, 32, 48):
            for n in (1, 3, 16, 64, 255, 256, 1024, 8192):
                cseq = cuda_weights.commit_sequences(n, hv, sms)
                blocks = -(-n // cseq) * hv
                assert cseq & (cseq - 1) == 0 and 1 <= cseq <= cuda_weights.CSEQ
                assert cseq == cuda_weights.CSEQ or blocks <= cuda_weights.COMMIT_BLOCKS * sms
                assert cseq == 1 or -(-n // (cseq // 2)) * hv > cuda_weights.COMMIT_BLOCKS * sms
    assert cuda_weights.commit_sequences(256, 32, 132) == 8 and cuda_weights.commit_sequences(16, 32, 132) == 1


def test_weights_blocks_take_a_key_heads_v_heads_together_only_for_large_batches():
    """decode_weights: a block a v head while its grid is small (the heads' chains side by side on more SMs),
    a block all the v heads of a key head from some batch size on (the keys staged and multiplied once), and
    never back; on an H200 (132 SMs) at 32 v heads: one sequence and 16 a head a block, 64 on together."""
    for sms in (1, 7, 132):
        for hv, ratio in ((4, 1), (32, 2), (48, 3), (64, 4)):
            picks = [cuda_weights.weights_heads(n, hv, ratio, sms) for n in range(1, 1025)]
            assert set(picks) <= {1, ratio} and picks[-1] == ratio
            first = picks.index(ratio)
            assert all(h == ratio for h in picks[first:])
    assert [cuda_weights.weights_heads(n, 32, 2, 132) for n in (1, 16, 64, 256)] == [1, 1, 2, 2]


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


def _rows_off_16_bytes(cache, names):
    """The cache's tensors `names` moved 8 bytes off a 16-byte boundary (a page stride can put them there):
    the kernels then load those rows 4 bytes at a time."""
    for name in names:
        t = getattr(cache, name)
        shift = 8 // t.element_size()
        moved = torch.zeros(t.numel() + shift, dtype=t.dtype, device=t.device)[shift:].view(t.shape)
        setattr(cache, name, moved.copy_(t))


def _first_difference(name, got, want, held):
    bad = (got != want).nonzero()
    where = tuple(bad[0].tolist())
    extra = f", held {int(held[where[0]])}" if name in ("t_row", "w_row", "p_row", "qg_row") else ""
    return f"{name}: {bad.shape[0]} of {got.numel()} differ, first at {where}{extra}: {got[where]} vs {want[where]}"


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("hk,hv,n,seed", [(16, 32, 45, 0), (16, 48, 29, 1), (2, 6, 70, 2), (4, 4, 64, 3)])
@pytest.mark.parametrize("heads", ["one", "all"])
def test_cuda_weights_kernel_matches_the_triton_kernel(hk, hv, n, seed, heads, monkeypatch):
    """decode_weights with a block a v head and with a block all the v heads of its key head."""
    monkeypatch.setattr(cuda_weights, "weights_heads", lambda n_seqs, hv, ratio, sms: 1 if heads == "one" else ratio)
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
    that start at the step (no state read) among them; in one case the cache's keys, states, x and V' rows off
    16-byte alignment."""
    gen = torch.Generator().manual_seed(seed)
    _, _, _, _, cache, start, held, slots = _random_case(hk, hv, n, seed)
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen) * 0.3)
    cache.state_dt.copy_(cache.state)  # the layout's invariant: the state rounded to bf16
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
        if seed == 6:
            _rows_off_16_bytes(ours, ("k", "state", "state_dt", "x", "vnew"))
        out = torch.full((n_rows, hv, D), 7.0, dtype=torch.bfloat16, device="cuda")
        triton_decode.decode_forward(q, k, v, a, b, A_log, dt_bias, out, ours, start, held, slots, read)
        results.append((out, ours))
    (want, want_cache), (got, got_cache) = results
    diffs = [] if torch.equal(got, want) else [_first_difference("out", got, want, held)]
    for m in ("state", "k", "x", "g", "beta", "t", "vnew", "state_dt"):
        x, y = getattr(got_cache, m), getattr(want_cache, m)
        if not torch.equal(x, y):
            diffs.append(_first_difference(f"cache.{m}", x, y, held))
    assert not diffs, "; ".join(diffs)


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """incremental_decode.cu compiled for the CPU (simt_harness.cpp, g++): its kernels as ctypes functions."""
    gxx = shutil.which("g++")
    assert gxx, "g++ compiles the CUDA kernels for their CPU emulation (Debian: apt install g++)"
    here, lib = Path(__file__).parent, tmp_path_factory.mktemp("simt") / "decode.so"
    cmd = [gxx, "-O1", "-std=c++20", "-pthread", "-ffp-contract=off", "-fPIC", "-shared", f"-I{here}",
           f'-DKERNEL_SOURCE="{cuda_weights.SOURCE}"', "-o", str(lib), str(here / "simt_harness.cpp")]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


def _toward_zero(state):
    """fp32 states rounded to bf16 toward zero, as the emulation's f2bf rounds (the GPU: to nearest even)."""
    return (state.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _assert_near(what, got, want, tol=1e-3):
    """Every element within tol of the tensor's largest magnitude (the sums' orders apart; a wrong element,
    fragment or row is off by the order of the values themselves)."""
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f"{what}: largest difference {err:.3g} against largest value {scale:.3g}"


def _host_call(fn, grid, args):
    c_args = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    fn(ctypes.c_int(grid), *c_args)


@pytest.mark.parametrize("hk,hv,seed", [(2, 2, 9), (2, 4, 10)])
def test_host_emulation_of_the_cuda_step_is_close_to_the_interpreted_step(host_kernels, interpreted_modules, hk, hv,
                                                                           seed):  # fmt: skip
    """The three CUDA kernels (g++, warps emulated) against the interpreted Triton step on the CPU, at Qwen3.5's
    head width (d_k = d_v = 128, chunks of 64): rows in the first and a later row tile, the completing row
    (state update), a fresh sequence (zero state) and a padded request, then random positions with two
    key heads (one and two v heads a key head, the cache's keys, states, x and V' rows then off 16-byte
    alignment: 4-byte loads);
    outputs and every cache tensor
    within the sums' orders (both round to bf16 toward zero here; exp2f against NumPy's exp)."""
    package = "vexact_vllm.kernels.gated_delta."
    dec = interpreted_modules(tuple(package + m for m in ("incremental_decode_triton", "incremental_tiles_triton",
                                                           "incremental_chunk_triton")))[0]  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    n_rows = 7
    cache = layout.IncrementalCache.empty(6, hk, hv, D, D, torch.bfloat16, "cpu")
    cache.k.copy_(F.normalize(torch.randn(cache.k.shape, generator=gen), dim=-1).bfloat16())
    cache.g.copy_(-torch.rand(cache.g.shape, generator=gen) * 0.1)
    cache.beta.copy_(torch.rand(cache.beta.shape, generator=gen).bfloat16().float())
    cache.t.copy_(torch.randn(cache.t.shape, generator=gen) * 0.2)
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen) * 0.3)
    cache.state_dt.copy_(_toward_zero(cache.state))  # the layout's invariant, rounded as the emulation rounds
    cache.x.copy_((torch.randn(cache.x.shape, generator=gen) * 0.5).bfloat16())
    cache.vnew.copy_((torch.randn(cache.vnew.shape, generator=gen) * 0.5).bfloat16())
    q, k = (torch.randn(n_rows, hk, D, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(n_rows, hv, D, generator=gen).bfloat16()
    a, b = (torch.randn(n_rows, hv, generator=gen).bfloat16() for _ in range(2))
    A_log = torch.log(torch.rand(hv, generator=gen) * 1.99 + 0.01)
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    start = torch.tensor([4, 0, 6, 2, 1])
    held = torch.tensor([5, 37, layout.CHUNK - 1, 0, 9]) if seed == 9 else torch.randint(1, layout.CHUNK, (5,), generator=gen)
    held[2], held[3] = layout.CHUNK - 1, 0  # a completing row; a fresh sequence
    slots = torch.tensor([3, 0, 5, 1, -1])
    read = torch.tensor([3, 0, 5, -1, -1])
    want_cache = layout.IncrementalCache(*(t.clone() for t in cache.tensors()))
    want = torch.zeros(n_rows, hv, D, dtype=torch.bfloat16)
    dec.decode_forward(q, k, v, a, b, A_log, dt_bias, want, want_cache, start, held, slots, read)

    q_hat, k_hat, x, g, beta = dec.prepared_rows(q, k, v, a, b, A_log, dt_bias)
    got_cache = layout.IncrementalCache(*(t.clone() for t in cache.tensors()))
    if seed == 10:
        _rows_off_16_bytes(got_cache, ("k", "state", "state_dt", "x", "vnew"))
    got = torch.zeros(n_rows, hv, D, dtype=torch.bfloat16)
    n = start.shape[0]
    rows = (torch.zeros(n, hv, layout.CHUNK), torch.zeros(n, hv, D, dtype=torch.bfloat16),
            torch.zeros(n, hv, layout.CHUNK, dtype=torch.bfloat16), torch.zeros(n, hv, D, dtype=torch.bfloat16))  # fmt: skip
    grid, args = cuda_weights.weights_args(q_hat, k_hat, g, beta, got_cache, start, held, slots, rows, sms=1)
    assert args[-2] == (seed != 10) and args[-1] == hv // hk  # ALIGN16; a block all the v heads of its key head
    _host_call(host_kernels.run_decode_weights, grid, args)
    vn_row = torch.zeros(n, hv, D, dtype=torch.bfloat16)
    assert cuda_weights.values_args(x, got, got_cache, start, held, slots, read, rows, vn_row)[1][-1] == (seed != 10)
    _host_call(host_kernels.run_decode_values,
               *cuda_weights.values_args(x, got, got_cache, start, held, slots, read, rows, vn_row))  # fmt: skip
    _host_call(host_kernels.run_decode_commit,
               *cuda_weights.commit_args(k_hat, g, x, got_cache, start, held, slots, read, vn_row, sms=1))  # fmt: skip
    live = slots >= 0
    _assert_near("out", got[start[live]], want[start[live]])
    for m in ("state", "k", "x", "g", "beta", "t", "vnew"):
        _assert_near(f"cache.{m}", getattr(got_cache, m), getattr(want_cache, m))
    # the rounded states where the kernels wrote them (the completing row's, the fresh sequence's zeros)
    assert torch.equal(got_cache.state_dt, _toward_zero(got_cache.state))
    assert not torch.equal(got_cache.state, cache.state)  # the completing row updated its slot's state
