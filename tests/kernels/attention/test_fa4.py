"""FlashAttention-4 as the attention of both sides (`kernels/attention/fa4.py`, VEXACT_ATTENTION=fa4).

On CPU: the choice and its refusals (an unknown backend, FA4 missing or of another version, a GPU
other than Hopper, groups). On an SM90 GPU with flash-attn-4 installed: a query's bits are the same
from the training call and from every paged step (whole prefill, chunked prefill, decode, mixed
steps, pages of 16 and 128), in CUDA graphs too; the backward is deterministic and accurate.
"""

import importlib
import math
import types

import pytest
import torch

from vexact_vllm.kernels import dispatch, paged_attention, varlen_attention
from vexact_vllm.kernels.settings import clear_settings, refresh_settings

fa4 = importlib.import_module("vexact_vllm.kernels.attention.fa4")


def _fa4_ready() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() in fa4._CAPABILITIES
        and fa4._installed_version() == fa4.FA4_VERSION
    )


needs_fa4 = pytest.mark.skipif(not _fa4_ready(), reason=f"needs an SM90 GPU and flash-attn-4=={fa4.FA4_VERSION}")


def test_attention_backend_follows_the_environment(monkeypatch):
    cpu, meta = torch.zeros(1), torch.zeros(1, device="meta")
    monkeypatch.setattr(dispatch, "backend_for", lambda t: "torch" if t.device.type == "cpu" else "triton")
    monkeypatch.delenv("VEXACT_KEY_SPLIT", raising=False)
    for value, want in (("", "triton"), ("triton", "triton"), ("fa4", "fa4")):
        monkeypatch.setenv("VEXACT_ATTENTION", value)
        refresh_settings()
        assert dispatch.attention_backend_for(meta) == want
        assert dispatch.attention_backend_for(cpu) == "torch"  # the reference path stays the reference
    monkeypatch.setenv("VEXACT_ATTENTION", "flash")
    with pytest.raises(ValueError, match="VEXACT_ATTENTION must be one of triton, fa4"):
        refresh_settings()
    with pytest.raises(ValueError, match="VEXACT_ATTENTION must be one of triton, fa4"):
        dispatch.attention_backend_for(meta)


def test_fa4_refuses_what_it_cannot_keep(monkeypatch):
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(fa4, "_installed_version", lambda: None)
    with pytest.raises(ValueError, match=r"flash-attn-4==4\.0\.0b36 .*it is not installed"):
        fa4.check_usable(q)
    monkeypatch.setattr(fa4, "_installed_version", lambda: "4.0.0b40")
    with pytest.raises(ValueError, match="it is 4.0.0b40"):
        fa4.check_usable(q)
    monkeypatch.setattr(fa4, "_installed_version", lambda: fa4.FA4_VERSION)
    with pytest.raises(ValueError, match=r"Hopper GPUs \(sm_90\) only, not on cpu"):
        fa4.check_usable(q)
    monkeypatch.setattr(fa4, "_capability", lambda index: (10, 0))
    with pytest.raises(ValueError, match="not on sm_100"):
        fa4.check_usable(types.SimpleNamespace(device=torch.device("cuda", 0), dtype=q.dtype, shape=q.shape))
    monkeypatch.setattr(fa4, "_capability", lambda index: (9, 0))
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match=r"takes bf16 with head_dim in \(128,\), got torch\.float"):
            fa4.check_usable(types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=q.shape))
    for head_dim in (64, 80, 96, 256):  # 128 only: the head dim whose rows are tested on a GPU
        with pytest.raises(ValueError, match=f"head_dim {head_dim}"):
            fa4.check_usable(types.SimpleNamespace(device=torch.device("cuda", 0), dtype=q.dtype, shape=(4, 2, head_dim)))
    fa4.check_usable(types.SimpleNamespace(device=torch.device("cuda", 0), dtype=q.dtype, shape=(4, 2, 128)))
    monkeypatch.setenv("VEXACT_ATTENTION", "fa4")
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "1024")  # the Triton attention's split: refused, never ignored
    clear_settings()
    with pytest.raises(ValueError, match="which takes no split"):
        fa4.check_usable(types.SimpleNamespace(device=torch.device("cuda", 0), dtype=q.dtype, shape=(4, 2, 128)))


def test_fa4_refuses_shared_prompt_groups(monkeypatch):
    monkeypatch.setenv("VEXACT_SHARED_PREFIX", "1")
    monkeypatch.setenv("VEXACT_ATTENTION", "fa4")
    with pytest.raises(ValueError, match="takes no groups: unset one of them"):
        refresh_settings()
    monkeypatch.setenv("VEXACT_ATTENTION", "triton")
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")  # the groups take no key split (on by default)
    assert refresh_settings().shared_prefix
    monkeypatch.setattr(fa4, "check_usable", lambda q: None)
    with pytest.raises(ValueError, match="does not take shared-prompt groups"):
        fa4.paged_attention(torch.zeros(1, 2, 64), None, None, None, torch.zeros(1), None, 1.0, shared=object())


def test_max_query_len_must_be_a_positive_int():
    q = torch.zeros(2, 2, 16)
    cache = torch.zeros(1, 16, 2, 16)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32), 0.25)  # fmt: skip
    for bad in (0, -3, 2.0):
        with pytest.raises(ValueError, match="max_query_len must be a positive int"):
            paged_attention(*args, max_query_len=bad)
    assert torch.equal(paged_attention(*args, max_query_len=2), paged_attention(*args))  # speed only


# ----------------------------------------------------------------------------- CUDA (SM90 + FA4)


def _packed(lens, hq, hkv, d, gen):
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def _cache(k, v, cu, page, gen):
    """vLLM's layout ([blocks, Hkv, page, 2D], K and V as strided views), shuffled pages, finite
    garbage in the unused slots; returns the views and the block table."""
    lens = (cu[1:] - cu[:-1]).tolist()
    per_seq = [-(-n // page) for n in lens]
    n_blocks = sum(per_seq) + 2
    hkv, d = k.shape[1], k.shape[2]
    kv = torch.randn(n_blocks, hkv, page, 2 * d, generator=gen).to("cuda", k.dtype)
    kc, vc = kv.transpose(1, 2)[..., :d], kv.transpose(1, 2)[..., d:]
    perm = torch.randperm(n_blocks, generator=gen)
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = perm[used : used + nb].int()
        used += nb
    for b, n in enumerate(lens):  # index_put_ on the strided views writes the cache itself
        pos = torch.arange(n)
        blocks, offsets = table[b, pos // page].long().cuda(), (pos % page).cuda()
        kc[blocks, offsets] = k[cu[b] : cu[b] + n]
        vc[blocks, offsets] = v[cu[b] : cu[b] + n]
    return kc, vc, table.cuda()


def _step(q, kc, vc, table, cu, chunks, scale, bound=False):
    """One engine step: sequence b's queries [start, end) = chunks[b], keys 0..end-1 already cached;
    `bound`: pass the longest query count (an eager step's max_query_len) instead of leaving it T."""
    seqs = [b for b, (s, e) in chunks.items() if e > s]
    rows = torch.cat([torch.arange(int(cu[b]) + s, int(cu[b]) + e) for b, (s, e) in ((b, chunks[b]) for b in seqs)])
    qsl = torch.tensor([0, *torch.tensor([chunks[b][1] - chunks[b][0] for b in seqs]).cumsum(0).tolist()],
                       dtype=torch.int32, device="cuda")  # fmt: skip
    seq_lens = torch.tensor([chunks[b][1] for b in seqs], dtype=torch.int32, device="cuda")
    longest = max(chunks[b][1] - chunks[b][0] for b in seqs) if bound else None
    out = paged_attention(q[rows.cuda()], kc, vc, table[seqs], seq_lens, qsl, scale, max_query_len=longest)
    return rows, out


@needs_fa4
@pytest.mark.cuda
@pytest.mark.parametrize("hq,hkv,page", [(16, 8, 16), (32, 8, 16), (16, 8, 128), (8, 8, 16)])
def test_fa4_paged_equals_training(monkeypatch, hq, hkv, page):
    """Random lengths (1..3000), whole prefill, chunks from random unaligned starts, decode steps and
    mixed steps: every query row equals the training call's, torch.equal."""
    monkeypatch.setenv("VEXACT_ATTENTION", "fa4")
    refresh_settings()
    gen = torch.Generator().manual_seed(hq * 1000 + page)
    d, scale = 128, 128**-0.5
    lens = [int(x) for x in torch.randint(1, 3000, (6,), generator=gen)] + [1, 129]
    q, k, v, cu = _packed(lens, hq, hkv, d, gen)
    train = varlen_attention(q, k, v, cu, scale)
    kc, vc, table = _cache(k, v, cu, page, gen)
    rows, out = _step(q, kc, vc, table, cu, {b: (0, n) for b, n in enumerate(lens)}, scale)
    assert torch.equal(out, train[rows.cuda()])
    for step in range(4):  # mixed steps: a chunk or a decode of each sequence at a random position
        chunks = {}
        for b, n in enumerate(lens):
            start = int(torch.randint(0, n, (1,), generator=gen))
            size = 1 if torch.rand((), generator=gen) < 0.5 else int(torch.randint(1, 300, (1,), generator=gen))
            chunks[b] = (start, min(start + size, n))
        rows, out = _step(q, kc, vc, table, cu, chunks, scale, bound=step % 2 == 1)
        assert torch.equal(out, train[rows.cuda()]), step


@needs_fa4
@pytest.mark.cuda
def test_fa4_decode_in_cuda_graphs(monkeypatch):
    """Decode captured once and replayed with other lengths and tables: the eager bits."""
    monkeypatch.setenv("VEXACT_ATTENTION", "fa4")
    refresh_settings()
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, page, batch = 16, 8, 128, 16, 24
    lens = [int(x) for x in torch.randint(1, 2000, (batch,), generator=gen)]
    q, k, v, cu = _packed(lens, hq, hkv, d, gen)
    kc, vc, table = _cache(k, v, cu, page, gen)
    q_step = torch.zeros(batch, hq, d, dtype=q.dtype, device="cuda")
    seq_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    out = torch.zeros_like(q_step)
    paged_attention(q_step, kc, vc, table, seq_lens.fill_(1), qsl, d**-0.5, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(q_step, kc, vc, table, seq_lens, qsl, d**-0.5, out=out)
    for _ in range(3):
        pos = torch.tensor([int(torch.randint(0, n, (1,), generator=gen)) for n in lens])
        q_step.copy_(q[(cu[:-1].cpu() + pos).cuda()])
        seq_lens.copy_(pos + 1)
        graph.replay()
        want = paged_attention(q_step, kc, vc, table, seq_lens, qsl, d**-0.5)
        assert torch.equal(out, want)


@needs_fa4
@pytest.mark.cuda
def test_fa4_backward_is_deterministic_and_accurate(monkeypatch):
    monkeypatch.setenv("VEXACT_ATTENTION", "fa4")
    refresh_settings()
    gen = torch.Generator().manual_seed(4)
    q, k, v, cu = _packed([700, 1, 1300, 64], 16, 8, 128, gen)
    g = torch.randn(q.shape, generator=gen).to("cuda", q.dtype)
    grads = []
    for _ in range(2):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = varlen_attention(qq, kk, vv, cu, 128**-0.5)
        grads.append((out, *torch.autograd.grad(out, (qq, kk, vv), g)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    ref_q, ref_k, ref_v = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        s = torch.einsum("qhd,khd->hqk", ref_q[lo:hi], ref_k[lo:hi].repeat_interleave(2, 1)) * 128**-0.5
        s = s.masked_fill(~torch.ones(hi - lo, hi - lo, dtype=torch.bool, device="cuda").tril(), -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), ref_v[lo:hi].repeat_interleave(2, 1)))
    ref = torch.cat(outs)
    ref_grads = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), g.double())
    torch.testing.assert_close(grads[0][0].double(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads[0][1:], ref_grads):
        torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)
