"""Attention with a value head size Dv different from the query/key head size D (DeepSeek's MLA: 192
and 128; small odd pairs 24/16, 40/24; heads that are not powers of two at all): the torch path, the
Triton kernels through the interpreter (small head counts), and the compiled kernels on CUDA.

The contract is the one of every head size (DESIGN rule 3): a query's bits are the same in training
(packed varlen), whole prefill, any chunked prefill, decode, mixed steps, with a key split and with
shared-prompt groups. Accuracy against a float64 reference uses tolerances; invariance is torch.equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.attention.test_triton import (
    TOL,
    PagedEngine,
    _run_chunked,
    check_invariance,
    compiled_attention,
    mixed_steps,
    packed_inputs,
    reference_attention,
)
from vexact_vllm.kernels import paged_attention, varlen_attention, write_kv_cache
from vexact_vllm.kernels.settings import clear_settings

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


class _TorchOps:
    """The public ops on CPU tensors: the torch path."""

    varlen_attention = staticmethod(varlen_attention)
    paged_attention = staticmethod(paged_attention)
    write_kv_cache = staticmethod(write_kv_cache)


# ----------------------------------------------------------------------------- torch path (CPU)


@pytest.mark.parametrize(
    "head_dim,head_dim_v,n_heads,n_kv,dtype",
    [(192, 128, 2, 2, torch.bfloat16), (24, 16, 4, 2, torch.float32), (40, 24, 3, 1, torch.bfloat16),
     (16, 40, 2, 1, torch.bfloat16)],
)  # fmt: skip
def test_torch_paged_equals_varlen(head_dim, head_dim_v, n_heads, n_kv, dtype):
    """Whole prefill, chunks of 64 and 7 and every position decoded, in vLLM's [blocks, Hkv, page, D + Dv]
    cache; and mixed steps."""
    ops = _TorchOps()
    q, k, v, cu, scale, train = check_invariance(
        ops, (1, 63, 64, 65, 130), n_heads, n_kv, head_dim, 16, dtype, chunks=(130, 64, 7, 1), head_dim_v=head_dim_v
    )  # fmt: skip
    assert train.shape == (q.shape[0], n_heads, head_dim_v)
    assert torch.equal(mixed_steps(ops, q, k, v, cu, 16, scale), train)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_accuracy_and_gradients(dtype):
    q, k, v, cu = packed_inputs((5, 70, 129), 4, 2, 40, dtype, head_dim_v=24)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu, 0.2)
    want_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*want_leaves, cu, 0.2)
    torch.testing.assert_close(out.double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    g = torch.randn(out.shape)
    (out.float() * g).sum().backward()
    (want * g.double()).sum().backward()
    for got, ref in zip([t.grad for t in leaves], [t.grad for t in want_leaves], strict=True):
        assert got.shape == ref.shape
        err = (got.double() - ref).norm() / ref.norm()
        assert err < {torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype], err


def test_write_kv_cache_with_two_head_sizes():
    """K and V of different sizes land in their parts of one [blocks, Hkv, page, D + Dv] tensor."""
    k, v = torch.randn(4, 2, 24), torch.randn(4, 2, 16)
    kv = torch.zeros(3, 2, 4, 40)
    k_cache, v_cache = kv[..., :24].transpose(1, 2), kv[..., 24:].transpose(1, 2)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([5, -1, 0, 11]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[2, 3], v[3]) and torch.equal(v_cache[0, 0], v[2])
    assert int((kv != 0).any(-1).sum()) == 2 * 3
    with pytest.raises(ValueError, match="matching caches"):
        write_kv_cache(k, v, k_cache, k_cache, torch.arange(4))


def test_out_buffer_is_the_value_head_size():
    q, k, v = torch.randn(3, 4, 24), torch.randn(3, 2, 24), torch.randn(3, 2, 16)
    kv = torch.zeros(1, 2, 4, 40)
    k_cache, v_cache = kv[..., :24].transpose(1, 2), kv[..., 24:].transpose(1, 2)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2]))
    args = (q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), 0.3)  # fmt: skip
    buffer = torch.zeros(3, 4 * 16)
    got = paged_attention(*args, out=buffer.view(3, 4, 16))
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, paged_attention(*args))
    with pytest.raises(ValueError, match=r"out must be \(3, 4, 16\)"):
        paged_attention(*args, out=torch.zeros(3, 4, 24))


# ----------------------------------------------------------------------------- interpreter (CPU)


@pytest.fixture(scope="module")
def interp(interpreted_attention):
    return interpreted_attention


@pytest.mark.parametrize(
    "head_dim,head_dim_v,n_heads,n_kv,dtype",
    [(192, 128, 2, 2, torch.bfloat16), (24, 16, 4, 2, torch.bfloat16), (40, 24, 2, 1, torch.float32),
     (16, 40, 2, 2, torch.bfloat16)],
)  # fmt: skip
def test_interpreted_paged_equals_varlen(interp, head_dim, head_dim_v, n_heads, n_kv, dtype):
    """Whole prefill, chunks of 64 and 7, every position decoded (pages of 16, NaN in unused slots),
    each sequence alone in the training layout; the values agree with float64."""
    lens = (1, 63, 65, 70)
    q, k, v, cu, scale, train = check_invariance(
        interp, lens, n_heads, n_kv, head_dim, 16, dtype, chunks=(70, 64, 7, 1), head_dim_v=head_dim_v
    )
    assert train.shape == (sum(lens), n_heads, head_dim_v)
    torch.testing.assert_close(train.double(), reference_attention(q, k, v, cu, scale), rtol=TOL[dtype],
                               atol=TOL[dtype])  # fmt: skip
    for b in range(len(lens)):
        lo, hi = cu[b].item(), cu[b + 1].item()
        alone = interp.varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo]), scale)
        assert torch.equal(alone, train[lo:hi])


def test_interpreted_mixed_steps_192_128(interp):
    """Steps mixing decodes and multi-tile prefill chunks (GQA 2) at DeepSeek's head sizes."""
    q, k, v, cu = packed_inputs((1, 64, 65, 70, 3), 4, 2, 192, torch.bfloat16, head_dim_v=128)
    train = interp.varlen_attention(q, k, v, cu, 192**-0.5)
    assert torch.equal(mixed_steps(interp, q, k, v, cu, 16, 192**-0.5), train)


@pytest.mark.parametrize("head_dim,head_dim_v", [(40, 24), (192, 128)])
def test_interpreted_gradients(interp, head_dim, head_dim_v):
    """The backward kernels (dQ, dK over D; dV, delta over Dv) against float64 autograd, fp32."""
    q, k, v, cu = packed_inputs((5, 70), 2, 1, head_dim, torch.float32, head_dim_v=head_dim_v)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    g = torch.randn(q.shape[0], 2, head_dim_v)
    out = interp.varlen_attention(*leaves, cu, 0.1)
    (out * g).sum().backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*ref_leaves, cu, 0.1)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    for got, ref in zip([t.grad for t in leaves], [t.grad for t in ref_leaves], strict=True):
        assert got.shape == ref.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.fixture
def split(interpreted_attention, monkeypatch):
    """64-key splits, split decode for steps of <= 40 tokens (tests/kernels/attention/test_key_split.py)."""
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "64")
    clear_settings()
    monkeypatch.setattr(interpreted_attention.paged, "_SPLIT_MAX_TOKENS", 40)
    return interpreted_attention


def test_interpreted_key_split_with_two_head_sizes(split):
    """Training folds the 64-key chunks in one program, chunked prefill too, decode runs a program per
    chunk and `_fold_kernel` over the Dv-wide partials: the same bits."""
    lens = (1, 65, 130)
    q, k, v, cu = packed_inputs(lens, 4, 2, 40, torch.bfloat16, head_dim_v=24)
    train = split.varlen_attention(q, k, v, cu, 0.2)
    for chunk in (130, 50, 1):
        assert torch.equal(_run_chunked(split, q, k, v, cu, 16, chunk, 0.2), train), chunk


def test_interpreted_shared_prefix_with_two_head_sizes(interp, monkeypatch):
    """Decode sequences sharing their prompt's cache blocks: the groups' prefix state (Dv wide) and the
    resumed programs give the training bits."""
    from vexact_vllm.kernels import shared_prefix_groups

    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")
    clear_settings()
    prompt, samples, n_heads, n_kv, d, dv = 130, 3, 4, 2, 24, 16
    page = 16
    lens = [prompt + 5] * samples
    q, k, v, cu = packed_inputs(lens, n_heads, n_kv, d, torch.bfloat16, head_dim_v=dv)
    for b in range(1, samples):  # the prompt's keys and values are the same in every sample
        k[cu[b] : cu[b] + prompt] = k[:prompt]
        v[cu[b] : cu[b] + prompt] = v[:prompt]
    train = interp.varlen_attention(q, k, v, cu, 0.3)
    shared_blocks = prompt // page
    n_blocks = shared_blocks + samples * 2 + 2
    kv = torch.full((n_blocks, n_kv, page, d + dv), float("nan"), dtype=torch.bfloat16)
    k_cache, v_cache = kv[..., :d].transpose(1, 2), kv[..., d:].transpose(1, 2)
    tables = []
    for b in range(samples):
        table = list(range(shared_blocks)) + [shared_blocks + 2 * b, shared_blocks + 2 * b + 1]
        for pos in range(lens[b]):
            k_cache[table[pos // page], pos % page] = k[cu[b] + pos]
            v_cache[table[pos // page], pos % page] = v[cu[b] + pos]
        tables.append(table)
    table = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(samples + 1, dtype=torch.int32)
    last = (cu[1:] - 1).long()
    shared = shared_prefix_groups(table, seq_lens, qsl, page, 8)
    assert int(shared.count[0]) == 1
    alone = interp.paged_attention(q[last], k_cache, v_cache, table, seq_lens, qsl, 0.3)
    grouped = interp.paged_attention(q[last], k_cache, v_cache, table, seq_lens, qsl, 0.3, shared=shared)
    assert torch.equal(alone, train[last]) and torch.equal(grouped, train[last])


def test_interpreted_head_sizes_refused(interp):
    """Multiples of 8 up to 256 (held in power-of-two tiles); others go to the torch path."""
    q, k, v, cu = packed_inputs((4,), 2, 2, 24, torch.float32, head_dim_v=12)
    with pytest.raises(ValueError, match="value head_dim that is a multiple of 8"):
        interp.varlen_attention(q, k, v, cu, 0.1)
    q, k, v, cu = packed_inputs((4,), 2, 2, 264, torch.float32, head_dim_v=16)
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        interp.varlen_attention(q, k, v, cu, 0.1)


# ----------------------------------------------------------------------------- CUDA

CUDA_LENS = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4097)


@pytest.fixture(scope="module")
def compiled():
    return compiled_attention()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "head_dim,head_dim_v,n_heads,n_kv,block_size",
    [(192, 128, 16, 16, 16), (192, 128, 8, 8, 64), (40, 24, 8, 2, 16), (24, 16, 4, 4, 32)],
)
def test_paged_equals_varlen_cuda(compiled, head_dim, head_dim_v, n_heads, n_kv, block_size):
    """Moonlight/DeepSeek-shaped heads (MHA over decompressed K/V) and odd pairs: training == whole
    prefill == chunked prefill == decode == mixed steps, and each sequence alone."""
    q, k, v, cu, scale, train = check_invariance(
        compiled, CUDA_LENS, n_heads, n_kv, head_dim, block_size, torch.bfloat16,
        chunks=(max(CUDA_LENS), 1000, 100, 64, 7, 1), device="cuda", head_dim_v=head_dim_v,
    )  # fmt: skip
    assert torch.equal(mixed_steps(compiled, q, k, v, cu, block_size, scale), train)
    for b in range(len(CUDA_LENS)):
        lo, hi = cu[b].item(), cu[b + 1].item()
        one = torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda")
        assert torch.equal(compiled.varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], one, scale), train[lo:hi])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy_and_gradients_cuda(compiled, dtype):
    q, k, v, cu = packed_inputs((1, 63, 64, 65, 129, 300, 1000), 8, 8, 192, dtype, device="cuda", head_dim_v=128)
    scale = 192**-0.5
    out = compiled.varlen_attention(q, k, v, cu, scale)
    torch.testing.assert_close(out.float(), reference_attention(q, k, v, cu, scale, dtype=torch.float32),
                               rtol=TOL[dtype], atol=TOL[dtype])  # fmt: skip
    assert torch.equal(_run_chunked(compiled, q, k, v, cu, 16, 777, scale), out)
    g = torch.randn(out.shape, device="cuda").to(dtype)
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        (compiled.varlen_attention(*leaves, cu, scale).float() * g.float()).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):  # deterministic
        assert torch.equal(a, b)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (reference_attention(*ref_leaves, cu, scale) * g.double()).sum().backward()
    for got, ref in zip(grads[0], ref_leaves, strict=True):
        err = (got.double() - ref.grad).norm() / ref.grad.norm()
        assert err < {torch.bfloat16: 5e-2, torch.float32: 1e-3}[dtype], err


def _mixed_pairs(n: int, seed: int) -> list[tuple[int, int]]:
    """(40, 24), (56, 8) (the pairs Triton 3.6 once faulted on) and n random pairs of multiples of 8, D != Dv."""
    gen = torch.Generator().manual_seed(seed)
    pairs = [(40, 24), (56, 8)]
    while len(pairs) < n + 2:
        d, dv = (8 * int(x) for x in torch.randint(1, 33, (2,), generator=gen))
        if d != dv:
            pairs.append((d, dv))
    return pairs


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("head_dim,head_dim_v", _mixed_pairs(6, seed=11))
def test_mixed_head_sizes_cuda(compiled, head_dim, head_dim_v):
    """Any two head sizes: training (forward, backward) runs, and chunked prefill and decode give its bits."""
    q, k, v, cu = packed_inputs((1, 63, 64, 65, 1000), 8, 2, head_dim, torch.bfloat16, device="cuda",
                                head_dim_v=head_dim_v)  # fmt: skip
    scale = head_dim**-0.5
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    train = compiled.varlen_attention(*leaves, cu, scale)
    train.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    for chunk in (1000, 37, 1):
        assert torch.equal(_run_chunked(compiled, q, k, v, cu, 16, chunk, scale), train.detach()), chunk


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("keys", [256, 2048])
def test_key_split_cuda(compiled, monkeypatch, keys):
    """A key split at 192/128: training, chunked prefill and split decode agree bit for bit."""
    monkeypatch.setenv("VEXACT_KEY_SPLIT", str(keys))
    clear_settings()
    q, k, v, cu = packed_inputs((1, 257, 1000, 4097), 16, 16, 192, torch.bfloat16, device="cuda", head_dim_v=128)
    train = compiled.varlen_attention(q, k, v, cu, 0.07)
    for chunk in (4097, 300, 1):
        assert torch.equal(_run_chunked(compiled, q, k, v, cu, 16, chunk, 0.07), train), chunk


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_replay_192_128(compiled):
    """write_kv_cache + paged_attention at 192/128 captured once in a CUDA graph, replayed."""
    from vexact_vllm.kernels.capture import gc_paused

    q, k, v, cu = packed_inputs((300, 5, 129), 16, 16, 192, torch.bfloat16, device="cuda", head_dim_v=128)
    train = compiled.varlen_attention(q, k, v, cu, 0.1)
    engine = PagedEngine(compiled, k, v, cu, 16)
    engine.step(q, {0: (0, 299), 1: (0, 4), 2: (0, 128)}, 0.1)
    last = [cu[b + 1].item() - 1 for b in range(3)]
    pos = torch.tensor([299, 4, 128])
    static = {"q": q[last].clone(), "k": k[last].clone(), "v": v[last].clone(),
              "slots": (engine._table_cpu[torch.arange(3), pos // 16].long() * 16 + pos % 16).cuda(),
              "seq_lens": (pos + 1).int().cuda(), "qsl": torch.arange(4, dtype=torch.int32, device="cuda")}  # fmt: skip

    def run():
        compiled.write_kv_cache(static["k"], static["v"], engine.k_cache, engine.v_cache, static["slots"])
        return compiled.paged_attention(static["q"], engine.k_cache, engine.v_cache, engine.block_table,
                                        static["seq_lens"], static["qsl"], 0.1)  # fmt: skip

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        out = run()
    graph.replay()
    assert torch.equal(out, train[last])


def test_fa4_refuses_two_head_sizes():
    """VEXACT_ATTENTION=fa4 refuses D != Dv with a message (its 192/128 path is not tested bitwise)."""
    from vexact_vllm.kernels.attention import fa4

    with pytest.raises(ValueError, match="equal query/key and value head sizes"):
        fa4.check_value_head_size(torch.zeros(4, 2, 192), 128)
    fa4.check_value_head_size(torch.zeros(4, 2, 128), 128)
