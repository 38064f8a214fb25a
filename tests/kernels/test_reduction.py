"""The reduction building blocks and the torch CPU behaviours the kernels rely on."""

import pytest
import torch

from vexact_vllm.kernels.reduction import row_sum, sequential_sum


@pytest.mark.parametrize("length", [7, 64, 1000, 40000])
def test_row_sum_single_row_equals_row_in_batch(threads, length):
    rows = torch.randn(5, length)
    for n in (1, 2):
        with threads(n):
            batch = row_sum(rows)
            for i in range(rows.shape[0]):
                assert torch.equal(row_sum(rows[i].clone()), batch[i])
                assert torch.equal(row_sum(rows[i : i + 1].clone().view(1, 1, length)).view(()), batch[i])


def test_row_sum_same_for_any_thread_count(threads):
    rows = torch.randn(64, 4096)
    with threads(1):
        one = row_sum(rows)
    with threads(2):
        two = row_sum(rows)
    assert torch.equal(one, two)


def test_sequential_sum_order():
    blocks = torch.tensor([[1e8, 1.0, -1e8, 1.0]], dtype=torch.float32)
    expected = ((blocks[:, 0] + blocks[:, 1]) + blocks[:, 2]) + blocks[:, 3]
    assert torch.equal(sequential_sum(blocks), expected)


@pytest.mark.parametrize(
    "fn,dtype",
    [
        (torch.exp, torch.float32),
        (torch.log, torch.float32),
        (torch.rsqrt, torch.float32),
        (torch.sqrt, torch.float32),
        (torch.cos, torch.float64),
        (torch.sin, torch.float64),
    ],
    ids=lambda p: getattr(p, "__name__", str(p)),
)
def test_elementwise_bits_do_not_depend_on_position(threads, fn, dtype):
    """The kernels assume these elementwise ops round an element the same wherever it sits
    (unlike torch.sigmoid / F.silu on CPU, whose scalar tail loop rounds differently)."""
    x = (torch.rand(100_000) * 20 + 1e-3).to(dtype)
    for n in (1, 2):
        with threads(n):
            full = fn(x)
            for offset in range(0, 20, 3):
                for length in (1, 7, 17, 1000, 40_000):
                    part = fn(x[offset : offset + length].clone())
                    assert torch.equal(part, full[offset : offset + length]), (offset, length)
