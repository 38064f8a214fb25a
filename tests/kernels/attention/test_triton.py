"""Triton attention (`kernels/attention/core_triton.py` and its entry modules `varlen_triton.py`,
`paged_triton.py`, `varlen_triton_bwd.py`): the kernels' logic on
CPU through the Triton interpreter (tiny shapes), and the compiled kernels on CUDA at real shapes.

The contract (DESIGN rule 3): a query at position p gets the same bits from the training kernel
(packed varlen) and from the paged kernel in any engine step: whole prefill, any chunked-prefill split,
decode, mixed batches, any block size, shuffled block tables, NaN in unused cache slots. Invariance
is always `torch.equal`; tolerances are only for accuracy against fp32/fp64 references.
"""

import importlib
import math
import types

import pytest
import torch

from vexact_vllm.kernels import KEY_TILE, paged_attention
from vexact_vllm.kernels.capture import gc_paused

pytest.importorskip("triton")

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module")
def interp(interpreted_attention):
    """The Triton attention under the Triton interpreter (tests/conftest.py `interpreted_attention`)."""
    return interpreted_attention


def compiled_attention() -> types.SimpleNamespace:
    """The Triton attention as vLLM and the trainer import it (compiled kernels), in the namespace of
    tests/conftest.py's `interpreted_attention`."""
    names = ("varlen_triton", "paged_triton", "varlen_triton_bwd", "prefix_triton", "core_triton")
    varlen, paged, bwd, prefix, core = (importlib.import_module(f"vexact_vllm.kernels.attention.{n}") for n in names)
    return types.SimpleNamespace(
        varlen_attention=varlen.varlen_attention, paged_attention=paged.paged_attention,
        write_kv_cache=paged.write_kv_cache, varlen=varlen, paged=paged, bwd=bwd, prefix=prefix, core=core,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compiled():
    return compiled_attention()


def reference_attention(q, k, v, cu_seqlens, scale, dtype=torch.float64):
    """Causal softmax attention in `dtype`, sequence by sequence (no TF32)."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for lo, hi in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs = q[lo:hi].to(dtype).transpose(0, 1)  # [Hq, n, D]
        ks = k[lo:hi].to(dtype).repeat_interleave(group, 1).transpose(0, 1)
        vs = v[lo:hi].to(dtype).repeat_interleave(group, 1).transpose(0, 1)
        s = torch.matmul(qs, ks.transpose(1, 2)) * scale
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).tril()
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        outs.append(torch.matmul(p, vs).transpose(0, 1))
    return torch.cat(outs)


def packed_inputs(seq_lens, n_heads, n_kv, head_dim, dtype, device="cpu", head_dim_v=None):
    """q, k [T, H, head_dim], v [T, Hkv, head_dim_v (None: head_dim)], cu_seqlens."""
    total = sum(seq_lens)
    q = torch.randn(total, n_heads, head_dim, device=device).to(dtype)
    k = torch.randn(total, n_kv, head_dim, device=device).to(dtype)
    v = torch.randn(total, n_kv, head_dim_v or head_dim, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


class PagedEngine:
    """A paged KV cache in vLLM's layout: one [num_blocks, Hkv, block_size, D + Dv] tensor whose K and V
    parts are seen as strided [num_blocks, block_size, Hkv, D or Dv] views, NaN-filled, each sequence on
    shuffled blocks. `step` plays one engine step: write the new K/V (plus padding slots -1), attend."""

    def __init__(self, ops, k, v, cu, block_size):
        self.ops, self.k, self.v, self.block_size = ops, k, v, block_size
        self.cu = cu.tolist()
        self.lens = [hi - lo for lo, hi in zip(self.cu[:-1], self.cu[1:])]
        per_seq = [-(-n // block_size) for n in self.lens]
        n_blocks = sum(per_seq) + 3
        n_kv, head_dim = k.shape[1], k.shape[2]
        kv = torch.full(
            (n_blocks, n_kv, block_size, head_dim + v.shape[2]), float("nan"), dtype=k.dtype, device=k.device
        )
        self.k_cache = kv[..., :head_dim].transpose(1, 2)
        self.v_cache = kv[..., head_dim:].transpose(1, 2)
        perm = torch.randperm(n_blocks)
        table = torch.zeros(len(self.lens), max(per_seq), dtype=torch.int32)
        used = 0
        for b, nb in enumerate(per_seq):
            table[b, :nb] = perm[used : used + nb].int()
            used += nb
        self.block_table = table.to(k.device)
        self._table_cpu = table

    def step(self, q, chunks, scale):
        """Sequence b gets its queries [start, end) = chunks[b]; returns {b: out [end - start, Hq, D]}."""
        seqs = [b for b, (s, e) in chunks.items() if e > s]
        rows = torch.cat([torch.arange(self.cu[b] + chunks[b][0], self.cu[b] + chunks[b][1]) for b in seqs])
        pos = torch.cat([torch.arange(*chunks[b]) for b in seqs])
        seq_of = torch.cat([torch.full((chunks[b][1] - chunks[b][0],), b) for b in seqs])
        slots = (
            self._table_cpu[seq_of, pos // self.block_size].long() * self.block_size + pos % self.block_size
        )
        pad = torch.full((2,), -1, dtype=torch.int64)
        dev = q.device
        zeros = torch.zeros(2, *self.k.shape[1:], dtype=self.k.dtype, device=dev)
        zeros_v = torch.zeros(2, *self.v.shape[1:], dtype=self.v.dtype, device=dev)
        rows_dev = rows.to(dev)
        self.ops.write_kv_cache(
            torch.cat([self.k[rows_dev], zeros]),
            torch.cat([self.v[rows_dev], zeros_v]),
            self.k_cache,
            self.v_cache,
            torch.cat([slots, pad]).to(dev),
        )
        q_lens = [chunks[b][1] - chunks[b][0] for b in seqs]
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([chunks[b][1] for b in seqs], dtype=torch.int32, device=dev)
        out = self.ops.paged_attention(
            q[rows_dev],
            self.k_cache,
            self.v_cache,
            self.block_table[torch.tensor(seqs, device=dev)],
            seq_lens,
            qsl.to(dev),
            scale,
        )
        return {b: out[qsl[i] : qsl[i + 1]] for i, b in enumerate(seqs)}


def _run_chunked(ops, q, k, v, cu, block_size, chunk, scale):
    """Chunked prefill of every sequence in `chunk`-token steps, all sequences batched in each step
    (chunk 1: every position decoded); `chunk` may be a function of the position a step starts at
    (the sequences advance in lockstep, so a step of size 1 is a decode step for all of them)."""
    size = chunk if callable(chunk) else lambda position: chunk
    engine = PagedEngine(ops, k, v, cu, block_size)
    out = torch.full((*q.shape[:2], v.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    done = [0] * len(engine.lens)
    while any(d < n for d, n in zip(done, engine.lens)):
        chunks = {b: (done[b], min(done[b] + size(done[b]), n)) for b, n in enumerate(engine.lens) if done[b] < n}
        for b, o in engine.step(q, chunks, scale).items():
            out[engine.cu[b] + chunks[b][0] : engine.cu[b] + chunks[b][1]] = o
            done[b] = chunks[b][1]
    return out


def check_invariance(
    ops, seq_lens, n_heads, n_kv, head_dim, block_size, dtype, chunks, device="cpu", head_dim_v=None
):
    q, k, v, cu = packed_inputs(seq_lens, n_heads, n_kv, head_dim, dtype, device, head_dim_v)
    scale = 1 / math.sqrt(head_dim)
    train = ops.varlen_attention(q, k, v, cu, scale)
    assert torch.isfinite(train).all()
    for chunk in chunks:
        assert torch.equal(_run_chunked(ops, q, k, v, cu, block_size, chunk, scale), train), chunk
    return q, k, v, cu, scale, train


def mixed_steps(ops, q, k, v, cu, block_size, scale):
    """Steps mixing decodes, prefill chunks and fresh prompts, sequences in a shuffled order."""
    lens = (cu[1:] - cu[:-1]).tolist()
    engine = PagedEngine(ops, k, v, cu, block_size)
    out = torch.full((*q.shape[:2], v.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    done = [0] * len(lens)
    rng = torch.Generator().manual_seed(1)
    while any(d < n for d, n in zip(done, lens)):
        order = torch.randperm(len(lens), generator=rng).tolist()
        chunks = {}
        for b in order:
            if done[b] < lens[b] and torch.rand((), generator=rng) < 0.7:
                size = (
                    1
                    if done[b] > 0 and torch.rand((), generator=rng) < 0.5
                    else int(torch.randint(1, 80, ()))
                )
                chunks[b] = (done[b], min(done[b] + size, lens[b]))
        if not chunks:
            continue
        for b, o in engine.step(q, chunks, scale).items():
            out[engine.cu[b] + chunks[b][0] : engine.cu[b] + chunks[b][1]] = o
            done[b] = chunks[b][1]
    return out


# ----------------------------------------------------------------------------- interpreter (CPU)

INTERP_LENS = (1, 63, 64, 65, 70)


def test_paged_equals_varlen_interpreted_gqa(interp):
    """GQA 4/2, bf16, block_size 16: whole prefill, chunks of 64 and 7, decode of every position."""
    q, k, v, cu, scale, train = check_invariance(
        interp, INTERP_LENS, 4, 2, 16, 16, torch.bfloat16, chunks=(max(INTERP_LENS), 64, 7, 1)
    )
    for b in range(len(INTERP_LENS)):  # each sequence alone in the training layout
        lo, hi = cu[b].item(), cu[b + 1].item()
        alone = interp.varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo]), scale)
        assert torch.equal(alone, train[lo:hi])


def test_paged_equals_varlen_interpreted_mha(interp):
    """MHA, fp32, head_dim 32, block_size 32, mixed decode/prefill steps."""
    q, k, v, cu, scale, train = check_invariance(
        interp, INTERP_LENS, 2, 2, 32, 32, torch.float32, chunks=(max(INTERP_LENS), 64)
    )
    assert torch.equal(mixed_steps(interp, q, k, v, cu, 32, scale), train)


def test_mixed_steps_with_multi_tile_chunks_interpreted(interp):
    """Steps mixing decodes with multi-tile prefill chunks (GQA 2: 32 tokens a tile): the training bits."""
    q, k, v, cu = packed_inputs((1, 63, 64, 65, 70, 3, 40), 4, 2, 16, torch.bfloat16)
    scale = 0.25
    train = interp.varlen_attention(q, k, v, cu, scale)
    assert torch.equal(mixed_steps(interp, q, k, v, cu, 16, scale), train)


def test_paged_stages_follow_the_step(monkeypatch, compiled):
    """A paged launch's pipelining depth: thin steps (at most 1 or 2 programs an SM) the deeper ones,
    groups their own, GPUs other than Hopper (no SM count: the interpreter too) and untabled head dims
    the forward's; the table (a benchmark fills it) above all."""
    monkeypatch.setattr(compiled.paged, "PAGED_STAGES", {})
    monkeypatch.setattr(compiled.paged, "THIN_STAGES", {128: ((1, 7), (2, 5))})
    monkeypatch.setattr(compiled.paged, "SHARED_STAGES", {128: 4})
    stages = compiled.paged.paged_stages
    for programs, shared, want in ((1, False, 7), (132, True, 7), (133, False, 5), (264, True, 5),
                                   (265, False, 3), (265, True, 4), (10_000, False, 3)):  # fmt: skip
        assert stages(128, programs, 132, shared, 3) == want, (programs, shared)
    assert stages(128, 8, None, False, 3) == 3 and stages(128, 8, None, True, 3) == 3  # not Hopper
    assert stages(64, 8, 132, False, 2) == 2
    monkeypatch.setitem(compiled.paged.PAGED_STAGES, 128, 2)
    assert stages(128, 8, 132, True, 3) == 2


def test_thin_step_depths_only_on_the_gpus_they_were_measured_on(monkeypatch, compiled):
    """7 stages need 148 KB of shared memory a program: Hopper's, not an sm_89 GPU's."""
    monkeypatch.setattr(compiled.paged, "_sm_count", lambda index: 128)
    for capability, want in (((9, 0), 128), ((8, 9), None), ((8, 0), None), ((10, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert compiled.paged._thin_sms.__wrapped__(0) == want, capability


@pytest.mark.parametrize("n_heads,dtype", [(4, torch.bfloat16), (6, torch.float32)])
def test_accuracy_interpreted(interp, n_heads, dtype):
    """GQA 2 and 3 (3 leaves a row of the 64-row tile unused); the paged whole prefill agrees."""
    q, k, v, cu = packed_inputs((1, 70, 65), n_heads, 2, 32, dtype)
    out = interp.varlen_attention(q, k, v, cu, 0.25)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, cu, 0.25), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(_run_chunked(interp, q, k, v, cu, 16, 70, 0.25), out)


def test_gradients_interpreted(interp):
    q, k, v, cu = packed_inputs((5, KEY_TILE + 6), 4, 2, 16, torch.float32)
    for t in (q, k, v):
        t.requires_grad_()
    g = torch.randn(q.shape)
    out = interp.varlen_attention(q, k, v, cu, 0.3)
    (out * g).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference_attention(qd, kd, vd, cu, 0.3)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    for got, ref in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_paged_padding_sequences_interpreted(interp):
    """Padded batch (CUDA graphs): trailing sequences with no queries and seq_len 0 change nothing."""
    q, k, v, cu = packed_inputs((65,), 4, 2, 16, torch.bfloat16)
    engine = PagedEngine(interp, k, v, cu, 16)
    want = engine.step(q, {0: (0, 65)}, 0.25)[0]
    table = torch.cat([engine.block_table, torch.zeros(2, engine.block_table.shape[1], dtype=torch.int32)])
    qsl = torch.tensor([0, 65, 65, 65], dtype=torch.int32)
    seq_lens = torch.tensor([65, 0, 0], dtype=torch.int32)
    got = interp.paged_attention(q, engine.k_cache, engine.v_cache, table, seq_lens, qsl, 0.25)
    assert torch.equal(got, want)


def test_write_kv_cache_interpreted(interp):
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    kv = torch.zeros(3, 2, 4, 16)  # vLLM's layout; K and V as strided views
    k_cache, v_cache = kv[..., :8].transpose(1, 2), kv[..., 8:].transpose(1, 2)
    interp.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([5, -1, 0, 11]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[2, 3], v[3])
    assert torch.equal(k_cache[0, 0], k[2]) and torch.equal(v_cache[0, 0], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3 and int((v_cache != 0).any(-1).any(-1).sum()) == 3


def test_bad_input_interpreted(interp):
    q, k, v, cu = packed_inputs((4,), 4, 2, 44, torch.float32)  # not a multiple of 8
    with pytest.raises(ValueError, match="head_dim"):
        interp.varlen_attention(q, k, v, cu, 0.1)
    kv = torch.zeros(2, 4, 2, 44)
    with pytest.raises(ValueError, match="head_dim"):
        interp.paged_attention(q, kv, kv, torch.tensor([[0]]), torch.tensor([4]), torch.tensor([0, 4]), 0.1)
    q, k, v, cu = packed_inputs((4,), 65, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="Hq / Hkv"):
        interp.varlen_attention(q, k, v, cu, 0.1)


# ----------------------------------------------------------------------------- CUDA

CUDA_LENS = (1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4097)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "head_dim,n_heads,n_kv,block_size", [(128, 16, 8, 16), (64, 8, 2, 32), (128, 8, 1, 16)]
)
def test_paged_equals_varlen_cuda(compiled, head_dim, n_heads, n_kv, block_size):
    q, k, v, cu, scale, train = check_invariance(
        compiled, CUDA_LENS, n_heads, n_kv, head_dim, block_size, torch.bfloat16,
        chunks=(max(CUDA_LENS), 1000, 100, 64, 7, 1), device="cuda",
    )  # fmt: skip
    assert torch.equal(mixed_steps(compiled, q, k, v, cu, block_size, scale), train)
    for b in range(len(CUDA_LENS)):  # each sequence alone: training layout and a one-sequence prefill
        lo, hi = cu[b].item(), cu[b + 1].item()
        one = torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda")
        assert torch.equal(compiled.varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], one, scale), train[lo:hi])
        alone = _run_chunked(compiled, q[lo:hi], k[lo:hi], v[lo:hi], one, block_size, hi - lo, scale)
        assert torch.equal(alone, train[lo:hi])


@pytest.mark.cuda
@needs_cuda
def test_large_batch_decode_cuda(compiled):
    """300 sequences (more than one 128-sequence chunk of the program -> sequence search): one step
    prefills all but the last token of each, the next decodes all the last tokens."""
    lens = torch.randint(1, 400, (300,)).tolist()
    q, k, v, cu = packed_inputs(lens, 16, 8, 128, torch.bfloat16, device="cuda")
    train = compiled.varlen_attention(q, k, v, cu, 0.1)
    engine = PagedEngine(compiled, k, v, cu, 16)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    for step in ({b: (0, n - 1) for b, n in enumerate(lens)}, {b: (n - 1, n) for b, n in enumerate(lens)}):
        for b, o in engine.step(q, step, 0.1).items():
            out[engine.cu[b] + step[b][0] : engine.cu[b] + step[b][1]] = o
    assert torch.equal(out, train)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("stages", [2, 5, 7])
def test_paged_pipelining_depth_changes_no_bit_cuda(compiled, monkeypatch, stages):
    """PAGED_STAGES (how many K/V tiles a program has in flight) at 2, 5 and 7: decode and prefill
    chunks equal to training, bit for bit."""
    monkeypatch.setitem(compiled.paged.PAGED_STAGES, 128, stages)
    q, k, v, cu = packed_inputs((1, 64, 129, 1000, 4097), 16, 8, 128, torch.bfloat16, device="cuda")
    train = compiled.varlen_attention(q, k, v, cu, 0.1)
    assert torch.equal(mixed_steps(compiled, q, k, v, cu, 16, 0.1), train)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (64, torch.float32)])
def test_accuracy_cuda(compiled, head_dim, dtype):
    q, k, v, cu = packed_inputs(CUDA_LENS, 8, 2, head_dim, dtype, device="cuda")
    scale = 1 / math.sqrt(head_dim)
    out = compiled.varlen_attention(q, k, v, cu, scale)
    want = reference_attention(q, k, v, cu, scale, dtype=torch.float32)
    torch.testing.assert_close(out.float(), want, rtol=TOL[dtype], atol=TOL[dtype])
    # fp32 inputs also exercise the paged kernel's ieee dots
    assert torch.equal(_run_chunked(compiled, q, k, v, cu, 16, 777, scale), out)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "head_dim,n_heads,n_kv,dtype",
    [(64, 8, 2, torch.bfloat16), (128, 16, 8, torch.bfloat16), (64, 8, 2, torch.float32)],
)
def test_gradients_cuda(compiled, head_dim, n_heads, n_kv, dtype):
    q, k, v, cu = packed_inputs((1, 63, 64, 65, 129, 300, 1000), n_heads, n_kv, head_dim, dtype, device="cuda")
    scale = 1 / math.sqrt(head_dim)
    g = torch.randn(q.shape, device="cuda").to(dtype)
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        (compiled.varlen_attention(*leaves, cu, scale).float() * g.float()).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):  # deterministic: no atomics
        assert torch.equal(a, b)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (reference_attention(*ref_leaves, cu, scale) * g.double()).sum().backward()
    tol = {torch.bfloat16: 5e-2, torch.float32: 1e-3}[dtype]
    for got, ref in zip(grads[0], ref_leaves):
        assert torch.isfinite(got).all()
        err = (got.double() - ref.grad).norm() / ref.grad.norm()
        assert err < tol, err


@pytest.mark.cuda
@needs_cuda
def test_paged_cuda_graph_replay(compiled):
    """write_kv_cache + paged_attention captured once in a CUDA graph, replayed with new metadata."""
    q, k, v, cu = packed_inputs((300, 5, 129), 16, 8, 128, torch.bfloat16, device="cuda")
    scale = 0.1
    train = compiled.varlen_attention(q, k, v, cu, scale)
    engine = PagedEngine(compiled, k, v, cu, 16)
    engine.step(q, {0: (0, 299), 1: (0, 4), 2: (0, 128)}, scale)  # prefill all but the last token
    n = 3
    static = {
        "q": torch.zeros(n, 16, 128, dtype=q.dtype, device="cuda"),
        "k": torch.zeros(n, 8, 128, dtype=q.dtype, device="cuda"),
        "v": torch.zeros(n, 8, 128, dtype=q.dtype, device="cuda"),
        "slots": torch.full((n,), -1, dtype=torch.int64, device="cuda"),
        "seq_lens": torch.ones(n, dtype=torch.int32, device="cuda"),
        "qsl": torch.arange(n + 1, dtype=torch.int32, device="cuda"),
    }

    def run():
        compiled.write_kv_cache(static["k"], static["v"], engine.k_cache, engine.v_cache, static["slots"])
        return compiled.paged_attention(
            static["q"],
            engine.k_cache,
            engine.v_cache,
            engine.block_table,
            static["seq_lens"],
            static["qsl"],
            scale,
        )

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        out = run()
    last = [cu[b + 1].item() - 1 for b in range(3)]
    pos = torch.tensor([299, 4, 128])
    table = engine._table_cpu
    static["q"].copy_(q[last])
    static["k"].copy_(k[last])
    static["v"].copy_(v[last])
    static["slots"].copy_((table[torch.arange(3), pos // 16].long() * 16 + pos % 16).cuda())
    static["seq_lens"].copy_((pos + 1).int().cuda())
    graph.replay()
    assert torch.equal(out, train[last])


@pytest.mark.cuda
@needs_cuda
def test_public_api_dispatches_to_triton_cuda(compiled, monkeypatch):
    from vexact_vllm.kernels import dispatch, varlen_attention, write_kv_cache

    monkeypatch.setattr(dispatch, "_CUDA_BACKEND", "triton")
    q, k, v, cu = packed_inputs((70, 1, 130), 4, 2, 64, torch.bfloat16, device="cuda")
    out = varlen_attention(q, k, v, cu, 0.125)
    assert torch.equal(out, compiled.varlen_attention(q, k, v, cu, 0.125))

    class _Public:
        pass

    public = _Public()
    public.paged_attention, public.write_kv_cache = paged_attention, write_kv_cache
    assert torch.equal(_run_chunked(public, q, k, v, cu, 16, 50, 0.125), out)


def test_paged_out_buffer_interpreted(interp):
    """`out=` writes into a strided view of a caller's buffer (vLLM's [T, Hq * D] output): same bits."""
    q, k, v, cu = packed_inputs((9, 5), 4, 2, 16, torch.bfloat16)
    engine = PagedEngine(interp, k, v, cu, 16)
    want = engine.step(q, {0: (0, 9), 1: (0, 5)}, 0.25)
    buffer = torch.full((16, 4 * 16), 7.0, dtype=torch.bfloat16)  # 2 rows past T stay untouched
    args = (q, engine.k_cache, engine.v_cache, engine.block_table, torch.tensor([9, 5], dtype=torch.int32),
            torch.tensor([0, 9, 14], dtype=torch.int32), 0.25)  # fmt: skip
    got = interp.paged_attention(*args, out=buffer[:14].view(14, 4, 16))
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:9].view(9, 4, 16), want[0]) and torch.equal(buffer[9:14].view(5, 4, 16), want[1])
    assert bool((buffer[14:] == 7.0).all())


def test_tile_count_is_one_program_a_decode(compiled):
    """The tile axis: one program a sequence for one-token decodes (the thin steps' grid: 16 decodes x 8
    kv heads stay 128 programs at any GQA group), and T // TOKENS + B where sequences have many tokens."""
    for n_seqs in (1, 16, 33, 256):
        assert compiled.core.tile_count(n_seqs, n_seqs, 16) == n_seqs
    assert compiled.core.tile_count(100, 3, 32) == 100 // 32 + 3
    assert compiled.core.tile_count(40, 20, 32) == 40 // 32 + 20


def test_empty_sequences_amid_a_batch_interpreted(interp):
    """Sequences with no tokens between others (training's packed batches), and decode steps of more
    sequences than a tile holds tokens (GQA 2: 32), where one program a sequence is the whole grid: each
    sequence gets its own bits, in the packed (training) and the paged (decode) layout."""
    q, k, v, cu = packed_inputs((5, 0, 40, 0, 0, 1, 33) + (3,) * 36, 4, 2, 16, torch.bfloat16)
    scale = 0.25
    train = interp.varlen_attention(q, k, v, cu, scale)
    for b in range(len(cu) - 1):
        lo, hi = cu[b].item(), cu[b + 1].item()
        if hi > lo:
            alone = interp.varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo]), scale)
            assert torch.equal(alone, train[lo:hi]), b
    assert torch.equal(_run_chunked(interp, q, k, v, cu, 16, 1, scale), train)
