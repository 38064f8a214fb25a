"""The conv state cache as vLLM's hybrid cache binds it: the causal conv's cached op on a cache whose
slots sit at a page stride (each slot contiguous, beside the other state tensors in one page per slot,
as `MambaSpec` lays them out) and with padded sequences (slot -1, no rows: a CUDA graph's padded
requests). The torch path and the Triton kernel (interpreter) must give the contiguous cache's bits,
touch nothing outside the call's slots and its own view, and leave a padded sequence's page alone. The
gated delta rule's caches: incremental_checks.paged_cache and check_padded_requests."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from gated_delta_reference import conv_inputs, packed_cu  # noqa: E402

from vexact_vllm.kernels.gated_delta.causal_conv1d import causal_conv1d_torch  # noqa: E402

WIDTH, CHANNELS = 4, 24
HK, HV, DK, DV = 1, 2, 16, 8


def _paged(slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pages uint8 [S, P], conv view [S, W - 1, C] fp32, state view [S, HV, DV, DK] fp32: another
    tensor of the page): both views at the page stride, after a gap, filled with random values (as a
    reused page holds)."""
    conv_bytes, state_bytes, gap = (WIDTH - 1) * CHANNELS * 4, HV * DV * DK * 4, 16
    pages = torch.zeros(slots, conv_bytes + state_bytes + 3 * gap, dtype=torch.uint8)
    conv = pages[:, gap : gap + conv_bytes].view(torch.float32).view(slots, WIDTH - 1, CHANNELS)
    start = 2 * gap + conv_bytes
    state = pages[:, start : start + state_bytes].view(torch.float32).view(slots, HV, DV, DK)
    g = torch.Generator().manual_seed(seed)
    conv.copy_(torch.randn(conv.shape, generator=g))
    state.copy_(torch.randn(state.shape, generator=g) * 0.1)
    assert not conv.is_contiguous() and not state.is_contiguous()
    return pages, conv, state


@pytest.fixture(params=["torch", "triton"])
def conv_op(request):
    if request.param == "torch":
        return causal_conv1d_torch
    pytest.importorskip("triton")
    (conv_mod,) = request.getfixturevalue("interpreted_modules")(("vexact_vllm.kernels.gated_delta.causal_conv1d_triton",))
    return conv_mod.causal_conv1d_triton


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_slots_and_padding_give_the_contiguous_bits(conv_op, seed):
    g = torch.Generator().manual_seed(seed)
    n_real = int(torch.randint(1, 4, (), generator=g))
    lengths = [int(x) for x in torch.randint(1, 7, (n_real,), generator=g)]
    n_pad = int(torch.randint(1, 3, (), generator=g))
    n_slots = n_real + 3
    slots_real = torch.randperm(n_slots, generator=g)[:n_real].to(torch.int32)
    slots = torch.cat([slots_real, torch.full((n_pad,), -1, dtype=torch.int32)])
    has_state = torch.cat([torch.rand(n_real, generator=g) < 0.6, torch.rand(n_pad, generator=g) < 0.5])
    cu = packed_cu(lengths + [0] * n_pad)

    pages, conv, state = _paged(n_slots, seed)
    conv_flat, state_before = conv.contiguous(), state.clone()
    conv_replayed = conv_flat.clone()
    before = pages.clone()

    x, w, _, _ = conv_inputs(lengths, CHANNELS, WIDTH, torch.float32, seed=seed)
    y = conv_op(x, w, None, cu, conv, slots, has_state)
    y_flat = conv_op(x, w, None, cu, conv_flat, slots, has_state)
    assert torch.equal(y, y_flat) and torch.equal(conv, conv_flat)
    assert torch.equal(state, state_before)  # the page's other tensor

    # As a CUDA graph replays the step: padding rows (random values) past the last sequence's end
    rows = torch.cat([x, torch.randn(int(torch.randint(1, 4, (), generator=g)), CHANNELS, generator=g)])
    y_replayed = conv_op(rows, w, None, cu, conv_replayed, slots, has_state)
    assert torch.equal(y_replayed[: x.shape[0]], y) and torch.equal(conv_replayed, conv_flat)

    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[slots_real.long()] = False
    assert torch.equal(pages[untouched], before[untouched])  # other slots' pages, padded sequences' none
    gaps = pages.clone()
    gaps[:, 16 : 16 + conv.shape[1] * CHANNELS * 4] = 0
    start = 32 + conv.shape[1] * CHANNELS * 4
    gaps[:, start : start + HV * DV * DK * 4] = 0
    assert not gaps.any()  # nothing written between or after the views


def test_slot_checks_name_the_layout():
    from vexact_vllm.kernels.gated_delta.causal_conv1d import causal_conv1d

    x, w, _, _ = conv_inputs([3], CHANNELS, WIDTH, torch.float32)
    conv = torch.zeros(4, WIDTH - 1, CHANNELS)
    has = torch.tensor([True])
    with pytest.raises(ValueError, match="each slot contiguously"):
        causal_conv1d(x, w, None, packed_cu([3]), conv.transpose(1, 2).contiguous().transpose(1, 2), torch.tensor([0]), has)
    with pytest.raises(ValueError, match=r"or -1 \(no slot\)"):
        causal_conv1d(x, w, None, packed_cu([3]), conv, torch.tensor([-2]), has)
    with pytest.raises(ValueError, match="distinct"):
        causal_conv1d(x[:2], w, None, packed_cu([1, 1]), conv, torch.tensor([1, 1]), torch.tensor([True, True]))
