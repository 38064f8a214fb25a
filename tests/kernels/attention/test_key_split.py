"""Key splits of the Triton attention (VEXACT_KEY_SPLIT, kernels/attention/core_triton.py "Key splits"):
training (one program folds the chunks), paged steps that fold in one program and split decode
(a program per chunk, then `_fold_kernel`) give every query row the same bits; rows before the
first split keep the unsplit bits; the values stay accurate; bad settings are refused."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.attention.test_triton import (
    TOL,
    PagedEngine,
    check_invariance,
    compiled_attention,
    mixed_steps,
    packed_inputs,
    reference_attention,
)
from vexact_vllm.kernels.settings import clear_settings

pytest.importorskip("triton")

LENS = (1, 63, 64, 65, 130, 200)  # rows in 1 to 4 chunks of 64 keys


def _decodes_near_splits(keys, length, rng, extra=6):
    """Step sizes for `_run_chunked`: positions within 3 of a split boundary (the first three
    included) and `extra` random ones decoded alone, prefill chunks up to the next one between them.
    Decoding every position costs the interpreter about 0.5 s a step; these are where a row's chunk
    count changes, where a chunk holds 1-3 keys or ends a tile short."""
    at = {p for j in range(0, length + keys, keys) for p in range(j - 3, j + 3) if 0 <= p < length}
    at |= set(torch.randint(0, length, (extra,), generator=rng).tolist())
    ordered = sorted(at)

    def size(position):
        return 1 if position in at else next((p for p in ordered if p > position), length) - position

    return size


@pytest.fixture
def split(interpreted_attention, monkeypatch):
    """The interpreted module with 64-key splits, split decode only for steps of <= 40 tokens (so the
    whole-prompt and 64-token steps fold in one program and the shorter ones split)."""
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "64")
    clear_settings()
    monkeypatch.setattr(interpreted_attention.paged, "_SPLIT_MAX_TOKENS", 40)
    return interpreted_attention


def _before_last_tokens(ops, lens, n_heads, n_kv, head_dim, scale, device="cpu"):
    """Sequences of `lens` in a paged engine holding every token but the last: (q, k, v, the training
    bits, the engine, the last tokens' packed rows); `_write_last` then writes the last K/V."""
    q, k, v, cu = packed_inputs(lens, n_heads, n_kv, head_dim, torch.bfloat16, device)
    train = ops.varlen_attention(q, k, v, cu, scale)
    engine = PagedEngine(ops, k, v, cu, 16)
    engine.step(q, {b: (0, n - 1) for b, n in enumerate(lens)}, scale)
    return q, k, v, train, engine, [cu[b + 1].item() - 1 for b in range(len(lens))]


def _write_last(ops, engine, k, v, lens, last):
    """The last tokens' K/V into their cache slots (pages of 16), as a decode step's KV write does."""
    pos = torch.tensor([n - 1 for n in lens])
    slots = engine._table_cpu[torch.arange(len(lens)), pos // 16].long() * 16 + pos % 16
    ops.write_kv_cache(k[last], v[last], engine.k_cache, engine.v_cache, slots.to(k.device))


def test_split_paged_equals_varlen_interpreted(split):
    """GQA 4/2, bf16, pages of 16: whole prefill, chunks of 64 and 9, decodes around every split."""
    decodes = _decodes_near_splits(64, max(LENS), torch.Generator().manual_seed(3))
    check_invariance(split, LENS, 4, 2, 16, 16, torch.bfloat16, chunks=(max(LENS), 64, 9, decodes))


@pytest.mark.parametrize("seed", [11, 12])
def test_split_random_shapes_interpreted(interpreted_attention, monkeypatch, seed):
    """Random lengths, heads, GQA, head size, page size, split size and dtype: every paged step
    (whole prompt, random chunks, decode) gives the training bits."""
    rng = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    keys, n_kv, group, head_dim = pick(64, 128), pick(1, 2), pick(1, 2, 3, 4), pick(16, 32)
    monkeypatch.setenv("VEXACT_KEY_SPLIT", str(keys))
    clear_settings()
    monkeypatch.setattr(interpreted_attention.paged, "_SPLIT_MAX_TOKENS", int(torch.randint(1, 60, (1,), generator=rng)))
    lens = torch.randint(1, 230, (int(torch.randint(2, 5, (1,), generator=rng)),), generator=rng).tolist()
    chunk = int(torch.randint(2, 40, (1,), generator=rng))
    check_invariance(
        interpreted_attention, lens, n_kv * group, n_kv, head_dim, pick(16, 32), pick(torch.bfloat16, torch.float32),
        chunks=(max(lens), chunk, _decodes_near_splits(keys, max(lens), rng)),
    )  # fmt: skip


def test_split_mixed_steps_interpreted(split):
    """Steps mixing decodes, prefill chunks and fresh prompts, MHA fp32, pages of 32."""
    q, k, v, cu = packed_inputs(LENS, 2, 2, 16, torch.float32)
    scale = 1 / math.sqrt(16)
    train = split.varlen_attention(q, k, v, cu, scale)
    assert torch.equal(mixed_steps(split, q, k, v, cu, 32, scale), train)


@pytest.mark.parametrize("fold_heads", [1, 4, 64])
def test_split_decode_with_padding_and_junk_workspaces(split, monkeypatch, fold_heads):
    """A decode step padded as vLLM's full CUDA graphs pad it (tokens past the sequences', sequences
    of no query), with every torch.empty buffer full of junk (NaN, chunk count 5): the workspaces'
    unwritten entries are never read, padding rows are never written, and the real tokens get the
    training bits, whatever the fold kernel's head block (6 heads: padded blocks of 4 and 64)."""
    monkeypatch.setattr(split.paged, "_FOLD_HEADS", fold_heads)
    lens = (40, 150, 70)  # one, three and two chunks of 64 keys
    q, k, v, train, engine, last = _before_last_tokens(split, lens, 6, 2, 16, 0.25)
    _write_last(split, engine, k, v, lens, last)
    qs = torch.cat([q[last], torch.randn(2, 6, 16).to(q.dtype)])  # 2 padding tokens
    table = torch.cat([engine.block_table, torch.zeros(2, engine.block_table.shape[1], dtype=torch.int32)])
    seq_lens = torch.tensor([*lens, 0, 0], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3, 3, 3], dtype=torch.int32)
    empty, made = torch.empty, []

    def junk(*shape, dtype=None, **kwargs):
        made.append(empty(*shape, dtype=dtype, **kwargs))
        return made[-1].fill_(5 if dtype in (torch.int32, torch.int64) else float("nan"))

    out = torch.full_like(qs, 7.0)
    monkeypatch.setattr(torch, "empty", junk)
    split.paged_attention(qs, engine.k_cache, engine.v_cache, table, seq_lens, qsl, 0.25, out=out)
    monkeypatch.setattr(torch, "empty", empty)
    assert torch.equal(out[:3], train[last])
    assert (out[3:] == 7).all()  # padding tokens' rows are never written
    counts = next(t for t in made if t.dtype == torch.int32)  # each token's chunk count
    assert counts[:3].tolist() == [1, 3, 2] and (counts[3:] == 5).all()


def test_split_keeps_short_rows_and_stays_accurate(interpreted_attention, monkeypatch):
    """Rows before key 64 have the unsplit bits; later rows go through the fold (some bits differ)
    and match an fp64 reference to bf16 rounding."""
    q, k, v, cu = packed_inputs(LENS, 4, 2, 16, torch.bfloat16)
    scale = 1 / math.sqrt(16)
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")
    clear_settings()
    plain = interpreted_attention.varlen_attention(q, k, v, cu, scale)
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "64")
    clear_settings()
    split = interpreted_attention.varlen_attention(q, k, v, cu, scale)
    pos = torch.cat([torch.arange(n) for n in LENS])
    assert torch.equal(split[pos < 64], plain[pos < 64])
    assert not torch.equal(split[pos >= 64], plain[pos >= 64])
    torch.testing.assert_close(split.double(), reference_attention(q, k, v, cu, scale), atol=TOL[torch.bfloat16], rtol=0)


def test_split_gradients_interpreted(interpreted_attention, monkeypatch):
    """The backward reads the folded log-sum-exp: gradients match the fp64 reference's."""
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "64")
    clear_settings()
    q, k, v, cu = packed_inputs((70, 150), 2, 1, 16, torch.float32)
    scale = 1 / math.sqrt(16)
    g = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(interpreted_attention.varlen_attention(*leaves, cu, scale), leaves, g)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference_attention(*ref_leaves, cu, scale), ref_leaves, g.double())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_split_is_on_by_default_except_under_fa4(monkeypatch):
    """Unset, the split is DEFAULT_KEY_SPLIT keys (both sides read the same default); 0 turns it off;
    FA4, which takes no split, runs without it when unset."""
    from vexact_vllm.kernels.dispatch import key_split
    from vexact_vllm.kernels.settings import DEFAULT_KEY_SPLIT

    monkeypatch.delenv("VEXACT_KEY_SPLIT", raising=False)
    monkeypatch.delenv("VEXACT_ATTENTION", raising=False)
    clear_settings()
    assert key_split() == DEFAULT_KEY_SPLIT == 2048
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "")
    clear_settings()
    assert key_split() == DEFAULT_KEY_SPLIT
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")
    clear_settings()
    assert key_split() == 0
    monkeypatch.setenv("VEXACT_ATTENTION", "fa4")
    clear_settings()
    assert key_split() == 0
    monkeypatch.delenv("VEXACT_KEY_SPLIT")
    clear_settings()
    assert key_split() == 0


@pytest.mark.parametrize("value", ["-64", "100", "abc", "64.0"])
def test_bad_split_refused(monkeypatch, value):
    from vexact_vllm.kernels.dispatch import key_split

    monkeypatch.setenv("VEXACT_KEY_SPLIT", value)
    clear_settings()
    with pytest.raises(ValueError, match="VEXACT_KEY_SPLIT must be 0"):
        key_split()


def test_split_refused_with_fa4_and_groups(interpreted_attention, monkeypatch):
    from vexact_vllm.kernels import SharedPrefix
    from vexact_vllm.kernels.dispatch import key_split

    monkeypatch.setenv("VEXACT_KEY_SPLIT", "1024")
    clear_settings()
    assert key_split() == 1024
    monkeypatch.setenv("VEXACT_ATTENTION", "fa4")
    clear_settings()
    with pytest.raises(ValueError, match="VEXACT_ATTENTION=fa4"):
        key_split()
    monkeypatch.delenv("VEXACT_ATTENTION")
    monkeypatch.delenv("VEXACT_KEY_SPLIT")  # the default split refuses the groups too, where rows reach it
    clear_settings()
    q = torch.randn(2, 4, 16)
    cache = torch.randn(4, 16, 2, 16)
    one = torch.zeros(2, dtype=torch.int32)
    shared = SharedPrefix(one, one, one, one, torch.zeros(1, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="shared-prompt groups.*set VEXACT_KEY_SPLIT=0"):
        interpreted_attention.paged_attention(
            q, cache, cache, torch.zeros(2, 129, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32), 0.25, shared=shared,
        )  # fmt: skip  (129 pages of 16: rows may reach key 2,064, past the split)


# ----------------------------------------------------------------------------- CUDA (the GPU host)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("keys,head_dim,n_heads,n_kv", [(256, 128, 32, 8), (1024, 128, 16, 8), (128, 64, 8, 2)])
def test_split_paged_equals_varlen_cuda(monkeypatch, keys, head_dim, n_heads, n_kv):
    """Compiled kernels, random lengths up to 3,000 keys: every entry point (whole prefill, chunks,
    split decode of every position) gives the training bits; rows before the split keep the unsplit
    bits."""
    from tests.kernels.attention.test_triton import CUDA_LENS

    compiled = compiled_attention()
    extra = torch.randint(keys, 3000, (3,), generator=torch.Generator().manual_seed(keys)).tolist()
    lens = (*CUDA_LENS, *extra)
    monkeypatch.setenv("VEXACT_KEY_SPLIT", str(keys))
    clear_settings()
    q, k, v, cu, scale, train = check_invariance(
        compiled, lens, n_heads, n_kv, head_dim, 16, torch.bfloat16, chunks=(max(lens), 300, 1), device="cuda"
    )  # the decode steps (few rows) split; the others fold in one program
    assert torch.equal(mixed_steps(compiled, q, k, v, cu, 16, scale), train)
    torch.testing.assert_close(train.double(), reference_attention(q, k, v, cu, scale), atol=TOL[torch.bfloat16], rtol=0)
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")
    clear_settings()
    plain = compiled.varlen_attention(q, k, v, cu, scale)  # the same inputs, unsplit
    pos = torch.cat([torch.arange(n) for n in lens]).cuda()
    assert torch.equal(train[pos < keys], plain[pos < keys])
    assert not torch.equal(train[pos >= keys], plain[pos >= keys])


@pytest.mark.cuda
@needs_cuda
def test_split_decode_in_a_cuda_graph(monkeypatch):
    """A split decode step captured once and replayed with longer sequences: the training bits (the
    1,500- and 700-key rows through the fold kernel, the 40-key row stored by its one program)."""
    from vexact_vllm.kernels.capture import gc_paused

    compiled = compiled_attention()
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "256")
    clear_settings()
    lens = (1500, 40, 700)
    q, k, v, train, engine, last = _before_last_tokens(compiled, lens, 16, 8, 128, 0.1, device="cuda")
    qs = torch.zeros(3, 16, 128, dtype=q.dtype, device="cuda")
    seq_lens = torch.ones(3, dtype=torch.int32, device="cuda")
    qsl = torch.arange(4, dtype=torch.int32, device="cuda")

    def run():
        return compiled.paged_attention(qs, engine.k_cache, engine.v_cache, engine.block_table, seq_lens, qsl, 0.1)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        out = run()
    _write_last(compiled, engine, k, v, lens, last)
    qs.copy_(q[last])
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    graph.replay()
    assert torch.equal(out, train[last])


def test_split_decode_follows_the_step_shape(interpreted_attention):
    """Steps of few tokens split, however many programs they have (wide steps too); a prefill-sized
    step folds in one program."""
    rule = interpreted_attention.paged.split_decode
    limit = interpreted_attention.paged._SPLIT_MAX_TOKENS
    assert rule(1) and rule(16) and rule(limit)
    assert not rule(limit + 1)


def test_no_fold_where_no_row_reaches_the_split(interpreted_attention, monkeypatch):
    """A launch whose rows cannot reach key C compiles without the fold (SPLIT_TILES 0: the same bits
    for rows before C, one accumulator instead of two); one that can keeps it. The dispatcher hands
    the Triton kernel the longest sequence it read from cu_seqlens."""
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "128")
    clear_settings()
    rule = interpreted_attention.core.key_split_tiles
    assert rule(128) == 0 and rule(129) == 2 and rule(10**6) == 2
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")
    clear_settings()
    assert rule(10**6) == 0
    from vexact_vllm.kernels.attention import causal

    seen = {}

    def spy(q, k, v, cu_seqlens, scale, longest=None):
        seen["longest"] = longest
        return q

    monkeypatch.setitem(causal._VARLEN_IMPLS, "torch", spy)
    q = torch.randn(9, 2, 16)
    causal.varlen_attention(q, q, q, torch.tensor([0, 3, 8, 9], dtype=torch.int32), 0.25)
    assert seen["longest"] == 5
