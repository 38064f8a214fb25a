import math

import pytest
import torch

from vexact_vllm.kernels import KEY_TILE, paged_attention, varlen_attention, write_kv_cache

SEQ_LENS = (1, 63, 64, 65, 127, 128, 129, 257)
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _reference(q, k, v, cu_seqlens, scale):
    """float64 causal softmax attention, sequence by sequence."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for lo, hi in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        qs = q[lo:hi].double().transpose(0, 1)  # [Hq, n, D]
        ks = k[lo:hi].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[lo:hi].double().repeat_interleave(group, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        outs.append((p @ vs).transpose(0, 1))
    return torch.cat(outs)


def _packed(seq_lens, n_heads, n_kv, head_dim, dtype):
    total = sum(seq_lens)
    q = torch.randn(total, n_heads, head_dim).to(dtype)
    k = torch.randn(total, n_kv, head_dim).to(dtype)
    v = torch.randn(total, n_kv, head_dim).to(dtype)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


class _PagedCache:
    """A paged KV cache filled with NaN, sequences on shuffled blocks, written with write_kv_cache."""

    def __init__(self, k, v, cu, block_size):
        lens = (cu[1:] - cu[:-1]).tolist()
        blocks_per_seq = [-(-n // block_size) for n in lens]
        n_blocks = sum(blocks_per_seq) + 3
        shape = (n_blocks, block_size, k.shape[1], k.shape[2])
        self.k_cache = torch.full(shape, float("nan"), dtype=k.dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=k.dtype)
        perm = torch.randperm(n_blocks)
        self.block_table = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
        used = 0
        for b, nb in enumerate(blocks_per_seq):
            self.block_table[b, :nb] = perm[used : used + nb].int()
            used += nb
        self.block_size, self.lens, self.cu = block_size, lens, cu.tolist()
        self.k, self.v = k, v

    def write(self, b, start, end):
        pos = torch.arange(start, end)
        slots = self.block_table[b, pos // self.block_size].long() * self.block_size + pos % self.block_size
        rows = slice(self.cu[b] + start, self.cu[b] + end)
        pad = torch.full((2,), -1, dtype=torch.int64)  # padding tokens vLLM marks with slot -1
        k = torch.cat([self.k[rows], torch.zeros(2, *self.k.shape[1:], dtype=self.k.dtype)])
        v = torch.cat([self.v[rows], torch.zeros(2, *self.v.shape[1:], dtype=self.v.dtype)])
        write_kv_cache(k, v, self.k_cache, self.v_cache, torch.cat([slots, pad]))

    def step(self, q, chunks, scale):
        """One engine step: sequence b gets queries [start, end) of chunks[b]; returns {b: out}."""
        seqs = [b for b, (s, e) in chunks.items() if e > s]
        for b in seqs:
            self.write(b, *chunks[b])
        qs = torch.cat([q[self.cu[b] + chunks[b][0] : self.cu[b] + chunks[b][1]] for b in seqs])
        qsl = torch.tensor([0, *torch.tensor([chunks[b][1] - chunks[b][0] for b in seqs]).cumsum(0).tolist()])
        out = paged_attention(
            qs,
            self.k_cache,
            self.v_cache,
            self.block_table[seqs],
            torch.tensor([chunks[b][1] for b in seqs], dtype=torch.int32),
            qsl.int(),
            scale,
        )
        return {b: out[qsl[i] : qsl[i + 1]] for i, b in enumerate(seqs)}


def _run_chunked(q, k, v, cu, block_size, chunk, scale):
    """Chunked prefill of every sequence in `chunk`-token steps, all sequences batched together."""
    cache = _PagedCache(k, v, cu, block_size)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    done = [0] * len(cache.lens)
    while any(d < n for d, n in zip(done, cache.lens, strict=True)):
        chunks = {b: (done[b], min(done[b] + chunk, n)) for b, n in enumerate(cache.lens) if done[b] < n}
        for b, o in cache.step(q, chunks, scale).items():
            out[cu[b] + chunks[b][0] : cu[b] + chunks[b][1]] = o
            done[b] = chunks[b][1]
    return out


@pytest.mark.parametrize(
    "n_heads,n_kv,head_dim,block_size,dtype",
    [
        (4, 2, 64, 16, torch.bfloat16),
        (4, 2, 64, 32, torch.bfloat16),
        (2, 2, 64, 16, torch.float32),
        (2, 2, 32, 32, torch.float32),
        (4, 2, 32, 32, torch.float32),
    ],
)
def test_paged_equals_varlen_for_any_chunking(n_heads, n_kv, head_dim, block_size, dtype):
    q, k, v, cu = _packed(SEQ_LENS, n_heads, n_kv, head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    train = varlen_attention(q, k, v, cu, scale)
    # Whole prefill, one batch (all sequences), and the mixed batch in other orders / alone.
    for chunk in (max(SEQ_LENS), 100, 64, 7, 1):  # 1 = prefill-free decode of every position
        assert torch.equal(_run_chunked(q, k, v, cu, block_size, chunk, scale), train), chunk
    # Each sequence alone in the training layout.
    for b in range(len(SEQ_LENS)):
        lo, hi = cu[b].item(), cu[b + 1].item()
        alone = varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo]), scale)
        assert torch.equal(alone, train[lo:hi])


def test_paged_decode_mixed_with_prefill():
    """A step holding decodes of some sequences and prefill chunks of others."""
    q, k, v, cu = _packed((65, 129, 40), 4, 2, 32, torch.bfloat16)
    train = varlen_attention(q, k, v, cu, 0.2)
    cache = _PagedCache(k, v, cu, 16)
    outs = cache.step(q, {0: (0, 64), 1: (0, 100)}, 0.2)
    outs.update(cache.step(q, {0: (64, 65), 1: (100, 128), 2: (0, 40)}, 0.2))
    outs2 = cache.step(q, {1: (128, 129)}, 0.2)
    assert torch.equal(outs[0], train[0:65][64:65])
    assert torch.equal(outs[1], train[65:194][100:128])
    assert torch.equal(outs[2], train[194:234])
    assert torch.equal(outs2[1], train[65:194][128:129])


def test_query_chunking_does_not_matter(monkeypatch):
    from vexact_vllm.kernels.attention import causal

    q, k, v, cu = _packed((200, 70), 2, 1, 32, torch.float32)
    full = varlen_attention(q, k, v, cu, 0.3)
    for chunk in (1, 13, 1000):
        monkeypatch.setattr(causal, "_QUERY_CHUNK", chunk)
        assert torch.equal(varlen_attention(q, k, v, cu, 0.3), full), chunk
    monkeypatch.setattr(causal, "_QUERY_CHUNK", 64)
    for budget in (1, 1 << 22):  # one query and one key tile at a time; every query of a chunk, every tile
        monkeypatch.setattr(causal, "_PRODUCT_BUDGET", budget)
        assert torch.equal(varlen_attention(q, k, v, cu, 0.3), full), budget


def test_thread_count_does_not_matter(threads):
    q, k, v, cu = _packed((130, 5), 4, 2, 32, torch.float32)
    with threads(1):
        one = varlen_attention(q, k, v, cu, 0.2)
    with threads(2):
        two = varlen_attention(q, k, v, cu, 0.2)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy(dtype):
    q, k, v, cu = _packed((1, 70, 150), 4, 2, 32, dtype)
    out = varlen_attention(q, k, v, cu, 0.25)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), _reference(q, k, v, cu, 0.25), rtol=TOL[dtype], atol=TOL[dtype])


def test_gradients_match_float64_reference():
    q, k, v, cu = _packed((5, 2 * KEY_TILE + 3), 4, 2, 16, torch.float32)
    for t in (q, k, v):
        t.requires_grad_()
    g = torch.randn(q.shape)
    (varlen_attention(q, k, v, cu, 0.3) * g).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    (_reference(qd, kd, vd, cu, 0.3) * g.double()).sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_write_kv_cache_skips_negative_slots():
    k = torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8)
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([5, -1, 0, 11]))
    assert torch.equal(k_cache.view(12, 2, 8)[5], k[0]) and torch.equal(v_cache.view(12, 2, 8)[11], v[3])
    assert torch.equal(k_cache.view(12, 2, 8)[0], k[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_bad_input_raises():
    q, k, v, cu = _packed((4,), 4, 2, 8, torch.float32)
    with pytest.raises(ValueError):
        varlen_attention(q.half(), k.half(), v.half(), cu, 0.1)
    with pytest.raises(ValueError):
        varlen_attention(q, k.bfloat16(), v, cu, 0.1)
    with pytest.raises(ValueError):
        varlen_attention(q[:, :3], k, v, cu, 0.1)  # Hq not a multiple of Hkv
    with pytest.raises(ValueError):
        varlen_attention(q, k, v[:, :1], cu, 0.1)  # v's heads differ from k's (its head size may differ)
    with pytest.raises(ValueError):
        varlen_attention(q, k, v[:3], cu, 0.1)  # v's tokens differ from k's
    with pytest.raises(ValueError):
        varlen_attention(q, k, v, torch.tensor([0, 3]), 0.1)  # does not end at T
    with pytest.raises(ValueError):
        varlen_attention(q, k, v, cu.float(), 0.1)
    with pytest.raises(ValueError):
        varlen_attention(q, k, v, cu, -1.0)
    k_cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError):
        write_kv_cache(k, v, k_cache.bfloat16(), k_cache.bfloat16(), torch.arange(4))
    with pytest.raises(ValueError):
        write_kv_cache(k, v, k_cache, k_cache.clone(), torch.arange(3))
    table = torch.tensor([[0, 1]])
    with pytest.raises(ValueError):
        paged_attention(q, k_cache, k_cache.clone(), table, torch.tensor([3]), torch.tensor([0, 4]), 0.1)
    with pytest.raises(ValueError):
        paged_attention(q, k_cache, k_cache.clone(), table, torch.tensor([4]), torch.tensor([0, 4.0]), 0.1)
    with pytest.raises(ValueError):
        paged_attention(
            q, k_cache[:, :, :1], k_cache.clone(), table, torch.tensor([4]), torch.tensor([0, 4]), 0.1
        )


def test_paged_out_buffer_and_bad_out():
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    k_cache, v_cache = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2]))
    args = (q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), 0.3)  # fmt: skip
    buffer = torch.zeros(3, 32)
    got = paged_attention(*args, out=buffer.view(3, 4, 8))
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer.view(3, 4, 8), paged_attention(*args))
    with pytest.raises(ValueError, match="out must be"):
        paged_attention(*args, out=torch.zeros(3, 4, 8, dtype=torch.bfloat16))
