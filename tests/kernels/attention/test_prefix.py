"""Shared-prefix decode attention (`kernels/attention/prefix.py`, `prefix_triton.py`):
GRPO's samples of one prompt read the prompt's cache blocks once per group, with the same bits as
each sequence alone and as the training kernel. Interpreter on CPU (tiny shapes), CUDA at real ones."""

import pytest
import torch

from vexact_vllm.kernels import max_group_members, shared_prefix_groups

pytest.importorskip("triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module")
def interp(interpreted_attention):
    return interpreted_attention


def _table(rows, width):
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def test_groups_by_first_block_with_their_common_whole_tiles():
    """A's three decodes share 5 blocks (80 keys: 1 tile); B's are too short for a whole tile; C is
    alone; D, a prefill chunk, shares A's first blocks but has 5 queries: never grouped."""
    table = _table([[1, 2, 3, 4, 5, 10, 11], [7, 8, 20], [1, 2, 3, 4, 5, 12, 13], [30, 31, 32, 33, 34, 35],
                    [1, 2, 3, 4, 5, 14], [7, 8, 21], [1, 2, 3, 4, 5, 6, 40]], 9)  # fmt: skip
    seq_lens = torch.tensor([109, 46, 109, 90, 95, 46, 110])
    qsl = torch.tensor([0, 1, 2, 3, 4, 5, 6, 11])
    g = shared_prefix_groups(table, seq_lens, qsl, 16, 8)
    order, members, tiles = g.order.tolist(), g.members.tolist(), g.tiles.tolist()
    assert sorted(order) == list(range(7)) and g.max_members == 8
    start = members.index(3)
    assert sorted(order[start : start + 3]) == [0, 2, 4] and sum(m > 0 for m in members) == 1
    assert tiles == [1, 0, 1, 0, 1, 0, 0]
    # groups of at most 2: A's first two form one, the third is alone
    g = shared_prefix_groups(table, seq_lens, qsl, 16, 2)
    assert g.members.tolist().count(2) == 1 and sum(t > 0 for t in g.tiles.tolist()) == 2
    # a group counts only the tiles every member shares: A2 shares 3 blocks (48 keys), so none
    table[4, 3] = 50
    assert shared_prefix_groups(table, seq_lens, qsl, 16, 8).tiles.tolist() == [0] * 7
    table[4, 3], seq_lens[4] = 4, 63  # A2 shares the blocks again but is shorter than one tile: not a member
    assert shared_prefix_groups(table, seq_lens, qsl, 16, 8).tiles.tolist() == [1, 0, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="max_members must be at least 2"):
        shared_prefix_groups(table, seq_lens, qsl, 16, 1)


def test_groups_are_listed_by_their_first_position():
    """`starts` lists each group's first position in `order`, rising, and `count` their number: the
    prefix kernel walks that list."""
    table = _table([[1, 2, 3, 4, 5, 10], [7, 8, 9, 6, 20], [1, 2, 3, 4, 5, 12], [30, 31, 32, 33, 34],
                    [7, 8, 9, 6, 21], [1, 2, 3, 4, 5, 14]], 7)  # fmt: skip
    seq_lens = torch.tensor([90, 70, 90, 70, 70, 90])
    qsl = torch.arange(7)
    g = shared_prefix_groups(table, seq_lens, qsl, 16, 8)
    members = g.members.tolist()
    assert g.count.tolist() == [2] and g.starts.tolist()[:2] == [p for p, m in enumerate(members) if m]
    assert [members[p] for p in g.starts.tolist()[:2]] == [3, 2]
    assert g.starts.tolist()[:2] == [0, 3]  # A (first block 1) sorts before B (7)
    g = shared_prefix_groups(table, seq_lens, qsl, 16, 2)  # A cut into two and one alone
    members = g.members.tolist()
    assert g.count.tolist() == [2] and [members[p] for p in g.starts.tolist()[:2]] == [2, 2]
    none = shared_prefix_groups(table[:4:3], seq_lens[:4:3], torch.arange(3), 16, 8)
    assert none.count.tolist() == [0]


def test_groups_into_preallocated_buffers():
    table = _table([[3, 4, 5, 6, 9], [3, 4, 5, 6, 8]], 6)
    out = tuple(torch.full((10,), -7, dtype=torch.int32) for _ in range(5))
    g = shared_prefix_groups(table, torch.tensor([70, 75]), torch.tensor([0, 1, 2]), 16, 4, out=out)
    assert all(v.data_ptr() == o.data_ptr() for v, o in zip(g[:5], out))
    assert g.tiles.tolist() == [1, 1] and sorted(g.members.tolist()) == [0, 2] and out[0][2] == -7
    assert g.count.tolist() == [1] and g.starts[0] == g.members.tolist().index(2) and out[4][1] == -7
    with pytest.raises(ValueError, match="out must hold 5 buffers"):
        shared_prefix_groups(table, torch.tensor([70, 75]), torch.tensor([0, 1, 2]), 16, 4, out=out[:3])


def _rollout_step(prompts, samples, generated, n_heads, n_kv, head_dim, page, device, seed=0):
    """One decode step of a rollout: each prompt's samples share its whole cache blocks (prefix
    caching); the rest of each sample (the prompt's partial block, its generated tokens) is its own.
    Plus two sequences outside any group: one sharing nothing, one 3-token prefill chunk. Returns the
    training layout (q, k, v, cu) of every full sequence and the engine's step (query rows, cache,
    block table, seq_lens, query_start_loc)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16

    def rand(n, h):
        return torch.randn(n, h, head_dim, generator=gen).to(dtype)

    seqs = []  # (k, v, whole shared blocks, group)
    for g, p in enumerate(prompts):
        pk, pv = rand(p, n_kv), rand(p, n_kv)
        for _ in range(samples):
            n = int(torch.randint(1, generated + 1, (), generator=gen))
            seqs.append((torch.cat([pk, rand(n, n_kv)]), torch.cat([pv, rand(n, n_kv)]), p // page, g))
    for n in (150, 140):
        seqs.append((rand(n, n_kv), rand(n, n_kv), 0, None))
    q_lens = [1] * (len(seqs) - 1) + [3]
    lens = [s[0].shape[0] for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    k, v = torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs])
    q = rand(int(cu[-1]), n_heads)
    n_blocks = sum(-(-n // page) for n in lens) + 4
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    kv = torch.full((n_blocks, n_kv, page, 2 * head_dim), float("nan"), dtype=dtype)
    k_cache, v_cache = kv[..., :head_dim].transpose(1, 2), kv[..., head_dim:].transpose(1, 2)
    tables, shared_blocks = [], {}
    for (sk, sv, whole, g), n in zip(seqs, lens):
        common = shared_blocks.setdefault(g, [perm.pop() for _ in range(whole)]) if g is not None else []
        table = common + [perm.pop() for _ in range(-(-n // page) - len(common))]
        for pos in range(n):
            k_cache[table[pos // page], pos % page] = sk[pos]
            v_cache[table[pos // page], pos % page] = sv[pos]
        tables.append(table)
    block_table = _table(tables, max(len(t) for t in tables) + 1)
    rows = torch.cat([torch.arange(int(cu[b + 1]) - ql, int(cu[b + 1])) for b, ql in enumerate(q_lens)])
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    train = to(q, k, v, cu)
    step = (rows.to(device), *to(k_cache, v_cache, block_table, torch.tensor(lens, dtype=torch.int32), qsl))
    return train, step


def _check_rollout_step(ops, device, prompts, samples, generated, n_heads, n_kv, head_dim, page, max_members):
    (q, k, v, cu), (rows, k_cache, v_cache, table, seq_lens, qsl) = _rollout_step(
        prompts, samples, generated, n_heads, n_kv, head_dim, page, device
    )
    scale = head_dim**-0.5
    train = ops.varlen_attention(q, k, v, cu, scale)[rows]
    shared = shared_prefix_groups(table, seq_lens, qsl, page, max_members)
    assert int((shared.tiles > 0).sum()) >= len(prompts) * min(samples, max_members) // 2  # groups formed
    alone = ops.paged_attention(q[rows], k_cache, v_cache, table, seq_lens, qsl, scale)
    grouped = ops.paged_attention(q[rows], k_cache, v_cache, table, seq_lens, qsl, scale, shared=shared)
    assert torch.isfinite(grouped).all()
    assert torch.equal(alone, train)
    assert torch.equal(grouped, train)
    return shared


@pytest.mark.parametrize("max_members,programs", [(32, None), (3, None), (3, 1), (2, 2)])
def test_shared_prefix_equals_training_interpreted(interp, monkeypatch, max_members, programs):
    """GQA 2, prompts of 70-200 tokens (1-3 whole shared tiles) x 4 samples, groups of 32 or cut into
    3s or 2s; the prefix launch with a program for each possible group, or fewer programs than groups
    (each walks several: `programs`)."""
    if programs is not None:
        monkeypatch.setattr(interp.prefix, "prefix_programs", lambda n_seqs, n_kv, sms: programs)
    shared = _check_rollout_step(interp, "cpu", [200, 70, 131], 4, 40, 4, 2, 16, 16, max_members)
    assert int(shared.members.max()) == min(4, max_members)
    assert int(shared.count[0]) > (programs or 0)  # the programs walked more than one group each


def test_prefix_programs_fill_the_gpu_once():
    from vexact_vllm.kernels.attention.prefix_triton import prefix_programs

    assert prefix_programs(256, 8, 132) == 33  # 264 programs: two an SM, one wave
    assert prefix_programs(40, 8, 132) == 20  # at most n_seqs // 2 groups
    assert prefix_programs(1, 8, 132) == 1 and prefix_programs(256, 8, None) == 128
    assert prefix_programs(4096, 1, 132) == 264


def test_shared_prefix_refuses_groups_wider_than_the_tile(interp):
    (q, _, _, _), (rows, k_cache, v_cache, table, seq_lens, qsl) = _rollout_step([100], 2, 5, 4, 2, 16, 16, "cpu")
    shared = shared_prefix_groups(table, seq_lens, qsl, 16, 33)  # 33 x 2 rows > 64
    with pytest.raises(ValueError, match="exceed the 64-row tile"):
        interp.paged_attention(q[rows], k_cache, v_cache, table, seq_lens, qsl, 0.25, shared=shared)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("n_heads,n_kv,samples", [(16, 8, 8), (32, 8, 16), (16, 8, 40)])
def test_shared_prefix_equals_training_cuda(n_heads, n_kv, samples):
    """Qwen3 shapes (GQA 2 and 4, D 128): 12 prompts of 64-1,100 tokens x 8, 16 or 40 samples (40
    groups are cut at max_group_members: 64 // GQA), up to 300 generated tokens each."""
    from tests.kernels.attention.test_triton import compiled_attention

    ops = compiled_attention()
    prompts = torch.randint(64, 1100, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    most = max_group_members(128, n_heads // n_kv)
    shared = _check_rollout_step(ops, "cuda", prompts, samples, 300, n_heads, n_kv, 128, 16, most)
    assert int(shared.members.max()) == min(samples, most)


def _random_step(rng, device="cpu"):
    """A decode step's block table as the prefix cache leaves it: prompts whose samples share their
    first blocks (some only partly), sequences sharing nothing, prefill chunks, and garbage past each
    row's own blocks."""
    page = rng.choice([16, 32])
    rows, lens, q_lens, next_block = [], [], [], 1000
    for _ in range(rng.randint(1, 12)):
        prompt = [rng.randrange(1, 900) for _ in range(rng.randint(1, 6))]
        for _ in range(rng.randint(1, 9)):
            diverge = rng.randint(0, len(prompt)) if rng.random() < 0.2 else len(prompt)
            own = [next_block + k for k in range(rng.randint(0, 4))]
            next_block += len(own)
            blocks = prompt[:diverge] + [rng.randrange(1, 900) for _ in range(len(prompt) - diverge)] + own
            lens.append(rng.randint(max(1, (len(blocks) - 1) * page + 1), len(blocks) * page))
            q_lens.append(1 if rng.random() < 0.85 else rng.randint(1, 5))
            rows.append(blocks)
    width = max(len(r) for r in rows) + rng.randint(0, 3)
    table = torch.tensor([r + [rng.randrange(0, 900) for _ in range(width - len(r))] for r in rows], dtype=torch.int32)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    qsl = torch.tensor([0, *torch.tensor(q_lens)[order].cumsum(0).tolist()], dtype=torch.int32)
    return table[order].to(device), torch.tensor(lens, dtype=torch.int32)[order].to(device), qsl.to(device), page


@pytest.mark.parametrize("seed", range(6))
def test_one_launch_grouping_equals_the_torch_composition_interpreted(interpreted_modules, seed):
    """The Triton grouping (prefix_groups_triton.py, the CUDA path) gives the torch
    composition's order, members and tiles element for element, on random steps."""
    import random

    mod = interpreted_modules(("vexact_vllm.kernels.attention.prefix_groups_triton",))[0]
    rng = random.Random(seed)
    for _ in range(4):
        table, seq_lens, qsl, page = _random_step(rng)
        max_members = rng.choice([2, 3, 8, 32])
        want = shared_prefix_groups(table, seq_lens, qsl, page, max_members)
        views = (*(torch.full((seq_lens.shape[0],), -5, dtype=torch.int32) for _ in range(4)),
                 torch.full((1,), -5, dtype=torch.int32))  # fmt: skip
        # small blocks: every loop runs several steps
        blocks = rng.choice([(64, 256, 64, 256), (16, 8, 2, 4), (8, 32, 1, 16), (4, 4, 4, 1)])
        mod.shared_prefix_groups(table, seq_lens, qsl, page, max_members, views, 64, blocks)
        _assert_same_groups(views, want)
        assert int(want.tiles.gt(0).sum()) > 0 or not bool(want.members.gt(0).any())


def _assert_same_groups(got, want):
    """order, members, tiles and count element for element; starts up to the count."""
    for name, a, b in zip(("order", "members", "tiles", "count"), (*got[:3], got[4]), (*want[:3], want[4])):
        assert torch.equal(a, b), (name, a.tolist(), b.tolist())
    n = int(want[4][0])
    assert torch.equal(got[3][:n], want[3][:n]), (got[3][:n].tolist(), want[3][:n].tolist())
    assert torch.equal(want[3][:n], torch.nonzero(want[1] >= 2).flatten().to(want[3].dtype))


@pytest.mark.cuda
@needs_cuda
def test_one_launch_grouping_equals_the_torch_composition_cuda():
    import random

    from vexact_vllm.kernels import reference_mode

    rng = random.Random(7)
    for _ in range(20):
        table, seq_lens, qsl, page = _random_step(rng, "cuda")
        max_members = rng.choice([2, 8, 32])
        got = shared_prefix_groups(table, seq_lens, qsl, page, max_members)
        with reference_mode():
            want = shared_prefix_groups(table, seq_lens, qsl, page, max_members)
        _assert_same_groups(got, want)


def test_max_group_members_follows_the_forward_tile():
    """As many sequences as the forward query tile has rows for (BLOCK_M / (Hq / Hkv)); refused where
    the Triton attention has no configuration."""
    from vexact_vllm.kernels.attention.core_triton import forward_config

    for head_dim in (64, 128, 256):
        for group in (1, 2, 4, 7):
            assert max_group_members(head_dim, group) == forward_config(head_dim, group)[0] // group
    assert max_group_members(128, 2) == 32
    with pytest.raises(ValueError, match="head_dim"):
        max_group_members(100, 2)  # not a multiple of 8
