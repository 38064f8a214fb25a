"""The attention metadata builder's tile schedule (vexact_vllm/attention.py): laid out longest last
into persistent buffers on CUDA, for batches of SCHEDULE_MIN_REQS requests or more, when
VEXACT_ATTENTION_SCHEDULE=1 asks for it; none elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vexact_vllm import attention  # noqa: E402


def _builder(device: str):
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=512))
    return attention.VexactAttentionMetadataBuilder(None, ["layer.0"], config, torch.device(device))


def _metadata(seq_lens: list[int], q_lens: list[int]):
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = len(seq_lens)
    return SimpleNamespace(
        causal=True, num_reqs=n, num_actual_tokens=int(starts[-1]), max_query_len=max(q_lens), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table_tensor=torch.zeros(n, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
    )  # fmt: skip


def test_cpu_builder_has_no_schedule():
    builder = _builder("cpu")
    assert builder._schedule_buffers is None  # the torch path ignores schedules: nothing to compute
    metadata = builder.build(0, _metadata([5] * 80, [1] * 80))
    assert metadata.schedule is None


def test_schedule_from_the_minimum_request_count_into_persistent_buffers(monkeypatch):
    builder = _builder("cpu")
    # the CUDA builder's buffers, on the CPU: the ops are the same torch ops
    builder._schedule_buffers = (torch.zeros(768, dtype=torch.int32), torch.zeros(769, dtype=torch.int32))
    small = attention.SCHEDULE_MIN_REQS - 1
    assert builder.build(0, _metadata([3] * small, [1] * small)).schedule is None
    gen = torch.Generator().manual_seed(0)
    n = attention.SCHEDULE_MIN_REQS + 7
    for _step in range(2):  # two steps: the same buffers
        seq_lens = torch.randint(1, 3000, (n,), generator=gen).tolist()
        q_lens = [1] * (n - 3) + [5, 0, 17]  # decodes, a prefill chunk, a padded request
        order, starts = builder.build(0, _metadata(seq_lens, q_lens)).schedule
        assert order.data_ptr() == builder._schedule_buffers[0].data_ptr()  # the same addresses each step
        assert starts.data_ptr() == builder._schedule_buffers[1].data_ptr()
        assert sorted(order.tolist()) == list(range(n))
        assert [seq_lens[i] for i in order.tolist()] == sorted(seq_lens)  # longest last
        assert starts.tolist() == [0, *torch.tensor([q_lens[i] for i in order.tolist()]).cumsum(0).tolist()]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_builder_writes_the_schedule_into_its_buffers(monkeypatch):
    monkeypatch.setenv("VEXACT_ATTENTION_SCHEDULE", "1")
    builder = _builder("cuda")
    n = attention.SCHEDULE_MIN_REQS
    metadata = _metadata([9] * (n - 1) + [2], [1] * n)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(metadata).items()}
    order, starts = builder.build(0, SimpleNamespace(**cuda)).schedule
    assert order.is_cuda and order.data_ptr() == builder._schedule_buffers[0].data_ptr()
    assert order.tolist() == [n - 1, *range(n - 1)] and starts.tolist() == list(range(n + 1))


def test_schedule_is_opt_in_for_ab_runs(monkeypatch):
    monkeypatch.setenv("VEXACT_ATTENTION_SCHEDULE", "1")
    assert attention.schedule_enabled()
    monkeypatch.setenv("VEXACT_ATTENTION_SCHEDULE", "yes")
    with pytest.raises(ValueError, match="VEXACT_ATTENTION_SCHEDULE must be 0 or 1"):
        attention.schedule_enabled()
    monkeypatch.delenv("VEXACT_ATTENTION_SCHEDULE")
    assert not attention.schedule_enabled()  # off unless asked for (docs/BENCHMARKS.md, session 20)
    assert _builder("cuda" if torch.cuda.is_available() else "cpu")._schedule_buffers is None
