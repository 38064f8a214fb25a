"""Attention over DeepSeek's latent (MLA in the absorbed form, model_patches/mla.py): one key head of
C latent + R rotary dims per token, the values its first C dims (a view of the same cells, as vLLM's
latent cache holds them). The torch path, the Triton kernels through the interpreter (small latents,
more query heads than a tile has rows), and the compiled kernels on CUDA at DeepSeek's 512 + 64.

The contract is every attention's (DESIGN rule 3): a query's bits are the same in training (packed
varlen), whole prefill, any chunked prefill, decode, mixed steps and with a key split. Accuracy
against float64 uses tolerances; invariance is torch.equal.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.attention.test_triton import TOL, PagedEngine, compiled_attention, reference_attention
from vexact_vllm.kernels import paged_attention, varlen_attention, write_kv_cache
from vexact_vllm.kernels.attention.latent import latent_attention_backward, values_in_keys
from vexact_vllm.kernels.settings import clear_settings

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


class _TorchOps:
    varlen_attention = staticmethod(varlen_attention)
    paged_attention = staticmethod(paged_attention)
    write_kv_cache = staticmethod(write_kv_cache)


def latent_inputs(seq_lens, n_heads, latent, rope, dtype, device="cpu"):
    """q [T, Hq, C + R], kv [T, 1, C + R], v = kv's first C dims (a view), cu_seqlens."""
    total = sum(seq_lens)
    q = torch.randn(total, n_heads, latent + rope, device=device).to(dtype)
    kv = torch.randn(total, 1, latent + rope, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, kv, kv[..., :latent], cu


class LatentEngine(PagedEngine):
    """`PagedEngine` over vLLM's latent cache: one [num_blocks, 1, block_size, C + R] tensor, NaN-filled;
    the key view is the whole row, the value view its first C cells."""

    def __init__(self, ops, k, v, cu, block_size):
        super().__init__(ops, k, v, cu, block_size)
        n_blocks = self.k_cache.shape[0]
        cache = torch.full((n_blocks, 1, block_size, k.shape[2]), float("nan"), dtype=k.dtype, device=k.device)
        self.k_cache = cache.transpose(1, 2)
        self.v_cache = self.k_cache[..., : v.shape[2]]
        assert values_in_keys(self.k_cache, self.v_cache)


def run_steps(ops, q, k, v, cu, block_size, scale, plan):
    """Every sequence through the latent engine in steps: `plan(b, done)` -> the next step's size."""
    lens = (cu[1:] - cu[:-1]).tolist()
    engine = LatentEngine(ops, k, v, cu, block_size)
    out = torch.full((*q.shape[:2], v.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        chunks = {b: (done[b], min(done[b] + plan(b, done[b]), n)) for b, n in enumerate(lens) if done[b] < n}
        for b, o in engine.step(q, chunks, scale).items():
            out[engine.cu[b] + chunks[b][0] : engine.cu[b] + chunks[b][1]] = o
            done[b] = chunks[b][1]
    return out


def check_latent(ops, lens, n_heads, latent, rope, dtype, block_size=16, device="cpu", chunks=(64, 7, 1)):
    """Training equals whole prefill, `chunks` (1: every position decoded) and random mixed steps, each
    sequence alone too; accuracy against float64. Returns the training output."""
    q, k, v, cu = latent_inputs(lens, n_heads, latent, rope, dtype, device)
    scale = (latent + rope) ** -0.5
    train = ops.varlen_attention(q, k, v, cu, scale)
    assert train.shape == (sum(lens), n_heads, latent) and torch.isfinite(train).all()
    torch.testing.assert_close(train.double(), reference_attention(q, k, v, cu, scale), rtol=TOL[dtype],
                               atol=TOL[dtype])  # fmt: skip
    for chunk in (max(lens), *chunks):
        got = run_steps(ops, q, k, v, cu, block_size, scale, lambda b, d, chunk=chunk: chunk)
        assert torch.equal(got, train), chunk
    rng = torch.Generator().manual_seed(len(lens))
    sizes = torch.randint(1, 40, (10_000,), generator=rng).tolist()
    assert torch.equal(run_steps(ops, q, k, v, cu, block_size, scale, lambda b, d: sizes[b * 97 + d]), train)
    for b in range(len(lens)):
        lo, hi = cu[b].item(), cu[b + 1].item()
        alone = ops.varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo], device=device), scale)
        assert torch.equal(alone, train[lo:hi]), b
    return train


# ----------------------------------------------------------------------------- torch path (CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_latent(dtype):
    check_latent(_TorchOps(), (1, 63, 65, 70), 3, 40, 16, dtype)


def latent_gradients(lens, n_heads, latent, rope, dtype, device="cpu", seed=0):
    """(the latent backward's (dq, dk + (dv, 0)) from a float64 forward's output and log-sum-exp,
    float64 autograd's (dq, dkv)), inputs drawn in `dtype`."""
    torch.manual_seed(seed)
    q, kv, _, cu = latent_inputs(lens, n_heads, latent, rope, dtype, device)
    scale = (latent + rope) ** -0.5
    qd, kvd = q.double().requires_grad_(), kv.double().requires_grad_()
    out = reference_attention(qd, kvd, kvd[..., :latent], cu, scale)
    g = torch.randn(out.shape, device=device, dtype=torch.float64).to(dtype)
    (out * g.double()).sum().backward()
    lse = []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):  # log2-units log-sum-exp, as the forward saves it
        s = torch.einsum("qhd,kd->qhk", qd[lo:hi].detach(), kvd[lo:hi, 0].detach()) * scale
        s = s.masked_fill(~torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=device).tril()[:, None], -float("inf"))
        lse.append(torch.logsumexp(s, -1) / math.log(2.0))
    dq, dk, dv = latent_attention_backward(g, q, kv, kv[..., :latent], out.detach().to(dtype),
                                           torch.cat(lse).float(), cu, scale)  # fmt: skip
    dkv = dk.double()
    dkv[..., :latent] += dv.double()
    return (dq, dkv), (qd.grad, kvd.grad)


@pytest.fixture(scope="module")
def interpreted_scores(interpreted_modules):
    """The latent backward's Triton elementwise passes imported with TRITON_INTERPRET=1 (CPU tensors)."""
    (scores,) = interpreted_modules(("vexact_vllm.kernels.attention.latent_scores_triton",))
    assert type(scores._probabilities_kernel).__name__ == "InterpretedFunction"
    return scores


@pytest.mark.parametrize("passes", ["torch", "triton"])
@pytest.mark.parametrize("block_elements", [1 << 26, 16 * 4 * 70])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_latent_backward_against_float64(dtype, tol, block_elements, passes, monkeypatch, request):
    """bf16: the products' operands in bf16 (p and dS rounded, as FlashAttention's backward) with fp32
    results; fp32 throughout for fp32 inputs. Against float64 autograd, relative to each gradient's scale;
    with every sequence in one query block, and in blocks of 16-30 queries (each reaching its own keys only).
    The elementwise passes as torch ops (the CPU's) and as `latent_scores_triton`'s kernels (CUDA's, here
    interpreted); in fp32 the kernels' results also within the last bits of the torch ops' (exp's
    implementation; in bf16 the interpreter rounds p and dS toward zero, the GPU to nearest)."""
    from vexact_vllm.kernels.attention import latent

    assert latent._scores_kernels(torch.device("cpu")) is None  # the torch ops on the CPU
    monkeypatch.setattr(latent, "_BLOCK_ELEMENTS", block_elements)
    (tq, tkv), (want_q, want_kv) = latent_gradients((1, 37, 70), 4, 48, 16, dtype)
    dq, dkv = tq, tkv
    if passes == "triton":
        scores = request.getfixturevalue("interpreted_scores")
        monkeypatch.setattr(latent, "_scores_kernels", lambda device: scores)
        (dq, dkv), _ = latent_gradients((1, 37, 70), 4, 48, 16, dtype)
    assert dq.dtype == dtype and dkv.shape == want_kv.shape
    for got, want, torch_ops in ((dq, want_q, tq), (dkv, want_kv, tkv)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < tol, err
        if passes == "triton" and dtype == torch.float32:
            assert (got.double() - torch_ops.double()).abs().max() / want.abs().max() < tol / 4


@pytest.mark.parametrize("n_heads,first_query,keys", [(4, 0, 70), (3, 5, 1100), (1, 0, 1)])
def test_interpreted_latent_score_passes(interpreted_scores, n_heads, first_query, keys):
    """probabilities_: exactly 0 past each row's query, exp(s scale - lse ln 2) elsewhere, its bf16 copy
    the fp32 result rounded; score_gradients_: (dP - D) p scale, in bf16 or in place in fp32. Keys past
    one 1,024-key program included. The interpreter rounds to bf16 toward zero (the GPU to nearest): its
    bf16 results are checked to one bf16 step."""
    scores = interpreted_scores
    gen = torch.Generator().manual_seed(keys)
    queries = min(keys - first_query, 7)
    rows = queries * n_heads
    s = torch.randn(rows, keys, generator=gen) * 4
    lse = torch.randn(rows, generator=gen) + 3
    query = first_query + torch.arange(rows) // n_heads
    causal = torch.arange(keys)[None, :] <= query[:, None]
    want = torch.where(causal, torch.exp(s * 0.3 - lse[:, None] * math.log(2.0)), 0.0)
    p = s.clone()
    low = scores.probabilities_(p, lse, first_query, n_heads, 0.3, torch.bfloat16)
    assert torch.equal(p[~causal], torch.zeros(int((~causal).sum()))) and low.dtype == torch.bfloat16
    torch.testing.assert_close(p, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(low.float(), p, rtol=2**-7, atol=0)
    p32 = s.clone()
    assert scores.probabilities_(p32, lse, first_query, n_heads, 0.3, torch.float32) is p32
    assert torch.equal(p32, p)
    dp, delta = torch.randn(rows, keys, generator=gen), torch.randn(rows, generator=gen)
    ds = scores.score_gradients_(dp.clone(), p, delta, 0.3, torch.bfloat16)
    torch.testing.assert_close(ds.float(), (dp - delta[:, None]) * p * 0.3, rtol=2**-7, atol=0)
    inplace = dp.clone()
    assert scores.score_gradients_(inplace, p, delta, 0.3, torch.float32) is inplace
    assert torch.equal(inplace, (dp - delta[:, None]) * p * 0.3)
    with pytest.raises(ValueError, match="fp32"):
        scores.probabilities_(s.double(), lse, first_query, n_heads, 0.3, torch.bfloat16)


def test_values_in_keys():
    kv = torch.zeros(5, 1, 24)
    assert values_in_keys(kv, kv[..., :16])
    assert not values_in_keys(kv, kv[..., :16].clone())  # the same values, other cells
    assert not values_in_keys(kv, kv[..., 8:])  # not the first cells
    kv2 = torch.zeros(5, 2, 24)
    assert not values_in_keys(kv2, kv2[..., :16])  # two key heads: not a latent


# ----------------------------------------------------------------------------- interpreter (CPU)


@pytest.fixture(scope="module")
def interp(interpreted_attention):
    return interpreted_attention


@pytest.mark.parametrize("n_heads,dtype", [(4, torch.bfloat16), (80, torch.bfloat16), (3, torch.float32)])
def test_interpreted_latent(interp, n_heads, dtype):
    """80 query heads: two head blocks of 40 rows read the one key head (`latent_config`)."""
    lens, chunks = ((1, 40), (1,)) if n_heads > 4 else ((1, 63, 70), (7, 1))
    check_latent(interp, lens, n_heads, 32, 16, dtype, chunks=chunks)


def test_interpreted_latent_gradients(interp):
    """The latent backward (fp32 recompute from the forward's log-sum-exp) against float64 autograd; the
    values' gradient reaches the key row's first cells through the view."""
    q, kv, _, cu = latent_inputs((5, 70), 4, 32, 16, torch.float32)
    q, kv = q.requires_grad_(), kv.requires_grad_()
    out = interp.varlen_attention(q, kv, kv[..., :32], cu, 0.1)
    g = torch.randn(out.shape)
    (out * g).sum().backward()
    qd, kvd = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    want = reference_attention(qd, kvd, kvd[..., :32], cu, 0.1)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(q.grad.double(), qd.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv.grad.double(), kvd.grad, rtol=1e-4, atol=1e-4)


def test_interpreted_latent_key_split(interp, monkeypatch):
    """64-key splits: training folds the chunks in one program; decode (steps of <= 40 tokens) runs a
    program per chunk and folds the C-wide partials: the same bits."""
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "64")
    clear_settings()
    monkeypatch.setattr(interp.paged, "_SPLIT_MAX_TOKENS", 40)
    q, k, v, cu = latent_inputs((130,), 4, 32, 16, torch.bfloat16)
    train = interp.varlen_attention(q, k, v, cu, 0.2)
    for chunk in (130, 1):
        assert torch.equal(run_steps(interp, q, k, v, cu, 16, 0.2, lambda b, d, chunk=chunk: chunk), train), chunk
    clear_settings()


def test_interpreted_latent_refuses_shared_prefix_and_odd_sizes(interp):
    from vexact_vllm.kernels import shared_prefix_groups

    q, k, v, cu = latent_inputs((20, 20), 4, 32, 16, torch.bfloat16)
    engine = LatentEngine(interp, k, v, cu, 16)
    seq_lens, qsl = torch.tensor([20, 20], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    groups = shared_prefix_groups(engine.block_table, seq_lens, qsl, 16, 4)
    with pytest.raises(ValueError, match="VEXACT_SHARED_PREFIX=0"):
        interp.paged_attention(q[:2], engine.k_cache, engine.v_cache, engine.block_table, seq_lens, qsl, 0.2,
                               shared=groups)  # fmt: skip
    q, k, v, cu = latent_inputs((5,), 2, 36, 12, torch.bfloat16)
    with pytest.raises(ValueError, match="latent of 8-512 dims"):
        interp.varlen_attention(q, k, v, cu, 0.2)


# ----------------------------------------------------------------------------- CUDA


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize(
    "n_heads,dtype",
    [(16, torch.bfloat16), (128, torch.bfloat16), (32, torch.bfloat16), (64, torch.bfloat16), (20, torch.float32)],
)
def test_cuda_latent_at_deepseek_sizes(n_heads, dtype):
    """512 + 64 in bf16 at 16 heads (Moonlight, V2-Lite; V3 at TP=8), 128 (V3 at TP=1: two head
    blocks), 32 and 64 (TP=4 and 2); 256 + 64 in fp32 at 20 heads (fp32 takes at most 256): every
    schedule against training, key splits included (sequences past 2,048 keys). Decode steps run in
    16-, 32- or 64-row tiles, training in 64-row ones."""
    ops = compiled_attention()
    lens = (1, 63, 65, 700) if n_heads > 16 else (1, 63, 65, 700, 2200)
    latent = 256 if dtype == torch.float32 else 512
    check_latent(ops, lens, n_heads, latent, 64, dtype, block_size=64, device="cuda")


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("n_heads", [16, 128])
def test_cuda_latent_backward_at_deepseek_sizes(n_heads):
    """512 + 64 in bf16 on cuBLAS's fp32-output products: against float64 autograd (relative to each
    gradient's scale), and the same bits when run again."""
    lens = (1, 300, 1100) if n_heads == 16 else (1, 300)
    (dq, dkv), (want_q, want_kv) = latent_gradients(lens, n_heads, 512, 64, torch.bfloat16, "cuda")
    for got, want in ((dq, want_q), (dkv, want_kv)):
        assert (got.double() - want).abs().max() / want.abs().max() < 2e-2
    (dq2, dkv2), _ = latent_gradients(lens, n_heads, 512, 64, torch.bfloat16, "cuda")
    assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2)


@pytest.mark.parametrize("heads,rows,group", [(3, 16, 3), (16, 16, 16), (20, 32, 20), (32, 32, 32), (64, 64, 64), (128, 64, 64)])
def test_latent_decode_rows(heads, rows, group):
    """A decode launch takes the smallest row tile that holds its heads (at most 64); training 64 rows."""
    from vexact_vllm.kernels.attention.core_triton import latent_config

    assert latent_config(512, 64, heads, decode=True)[:2] == (group, rows)
    assert latent_config(512, 64, heads)[1] == 64


def test_compiled_fp32_latent_refuses_past_256_dims(monkeypatch):
    """fp32 runs one stage; past 256 latent dims its tiles exceed an SM's shared memory: a clear error."""
    from vexact_vllm.kernels.attention import core_triton

    monkeypatch.setattr(core_triton, "interpreted", lambda: False)
    assert core_triton.latent_config(256, 64, 16, fp32=True)[3] == 1
    assert core_triton.latent_config(512, 64, 16)[3] == core_triton.LATENT_FWD_CONFIG[2]
    with pytest.raises(ValueError, match="float32 latent attention on the GPU takes at most 256"):
        core_triton.latent_config(512, 64, 16, fp32=True)
