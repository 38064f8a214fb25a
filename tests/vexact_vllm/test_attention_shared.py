"""The attention metadata builder's shared-prompt groups (vexact_vllm/attention.py): with
VEXACT_SHARED_PREFIX=1 on CUDA, for steps of 2+ requests, written into persistent buffers that CUDA
graphs read; never elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vexact_vllm import attention  # noqa: E402
from vexact_vllm.kernels.settings import clear_settings, refresh_settings  # noqa: E402


def _builder(device: str, heads: int = 16, kv_heads: int = 8, compilation=None):
    model = SimpleNamespace(get_num_attention_heads=lambda parallel: heads)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=512),
                             model_config=model, parallel_config=None, compilation_config=compilation)  # fmt: skip
    spec = SimpleNamespace(num_kv_heads=kv_heads, block_size=16, head_size=128)
    return attention.VexactAttentionMetadataBuilder(spec, ["layer.0"], config, torch.device(device))


def _metadata(tables: list[list[int]], seq_lens: list[int], q_lens: list[int], device: str = "cpu"):
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return SimpleNamespace(
        causal=True, num_reqs=len(seq_lens), num_actual_tokens=int(starts[-1]), max_query_len=max(q_lens),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_table_tensor=table.to(device),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64, device=device),
    )  # fmt: skip


def test_groups_sized_by_the_query_tile_into_persistent_buffers():
    builder = _builder("cpu", heads=32, kv_heads=8)  # 4 query heads a kv head: 16 members at most
    assert builder._shared_buffers is None  # CPU: the torch backend reads no groups
    builder._max_members, builder._page = attention.max_group_members(128, 4), 16
    builder._shared_buffers = tuple(torch.zeros(768, dtype=torch.int32) for _ in range(5))
    prompt = list(range(100, 110))  # 10 whole blocks: 160 keys, 2 tiles
    tables = [prompt + [200 + i] for i in range(20)] + [[300, 301]]
    for _step in range(2):
        shared = builder.build(0, _metadata(tables, [170] * 20 + [20], [1] * 21)).shared
        assert shared.order.data_ptr() == builder._shared_buffers[0].data_ptr()
        assert shared.tiles.data_ptr() == builder._shared_buffers[2].data_ptr()
        assert sorted(shared.members.tolist(), reverse=True)[:3] == [16, 4, 0]  # 20 members cut at 16
        assert shared.tiles.tolist() == [2] * 20 + [0] and shared.max_members == 16
        assert shared.count.tolist() == [2] and shared.count.data_ptr() == builder._shared_buffers[4].data_ptr()
    assert builder.build(0, _metadata([prompt], [170], [1])).shared is None  # one request: no group


@pytest.mark.parametrize("graphs", [None, 8])
def test_eager_prefill_steps_skip_the_grouping(graphs):
    """A step with a prefill chunk and more tokens than the largest CUDA graph (every step with one
    when graphs are off) runs eagerly: no graph reads the buffers, so it skips the grouping. Steps a
    graph may replay keep it whatever they hold, so capture and replay launch the same kernels."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = None if graphs is None else SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL,
                                                               max_cudagraph_capture_size=graphs)  # fmt: skip
    builder = _builder("cpu", compilation=compilation)
    builder._max_members, builder._page = attention.max_group_members(128, 2), 16
    builder._shared_buffers = tuple(torch.zeros(64, dtype=torch.int32) for _ in range(5))
    tables = [list(range(100, 110)) + [200 + i] for i in range(4)]
    decodes = _metadata(tables, [170] * 4, [1] * 4)
    assert builder.build(0, decodes).shared.tiles.tolist() == [2] * 4  # decode-only: grouped, eager or not
    small = builder.build(0, _metadata(tables, [170] * 4, [1, 1, 1, 3])).shared  # 6 tokens
    big = builder.build(0, _metadata(tables, [170] * 4, [1, 1, 1, 9])).shared  # 12 tokens
    assert big is None
    if graphs is None:
        assert small is None
    else:  # 6 tokens fit an 8-token graph: built, its three decodes grouped
        assert small.tiles.tolist() == [2, 2, 2, 0]
    # The longest query count reaches the kernels (FA4's grid) only where no graph replays the step.
    assert builder.build(0, _metadata(tables, [170] * 4, [1, 1, 1, 9])).max_query_len == 9
    assert builder.build(0, _metadata(tables, [170] * 4, [1, 1, 1, 3])).max_query_len == (3 if graphs is None else None)
    assert builder.build(0, decodes).max_query_len is None


def test_shared_prefix_is_opt_in(monkeypatch):
    """Off unless VEXACT_SHARED_PREFIX=1, which takes no key split (the settings refuse the default)."""
    monkeypatch.setenv("VEXACT_SHARED_PREFIX", "1")
    monkeypatch.delenv("VEXACT_KEY_SPLIT", raising=False)  # the default key split: the groups refuse it
    with pytest.raises(ValueError, match="takes no key split.*set VEXACT_KEY_SPLIT=0 on the trainer and the rollout"):
        refresh_settings()
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")
    assert refresh_settings().shared_prefix
    monkeypatch.setenv("VEXACT_SHARED_PREFIX", "on")
    with pytest.raises(ValueError, match="VEXACT_SHARED_PREFIX must be 0 or 1"):
        refresh_settings()
    monkeypatch.delenv("VEXACT_SHARED_PREFIX")
    assert not refresh_settings().shared_prefix


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_builder_groups_shared_prompts(monkeypatch):
    monkeypatch.setenv("VEXACT_SHARED_PREFIX", "1")
    monkeypatch.setenv("VEXACT_KEY_SPLIT", "0")
    clear_settings()
    builder = _builder("cuda")
    assert builder._max_members == 32 and builder._page == 16
    tables = [[5, 6, 7, 8, 9, 40 + i] for i in range(8)]
    shared = builder.build(0, _metadata(tables, [90] * 8, [1] * 8, "cuda")).shared
    assert shared.order.is_cuda and shared.order.data_ptr() == builder._shared_buffers[0].data_ptr()
    assert shared.tiles.tolist() == [1] * 8 and sorted(shared.members.tolist())[-1] == 8
    monkeypatch.setenv("VEXACT_SHARED_PREFIX", "0")
    clear_settings()
    assert _builder("cuda")._shared_buffers is None
