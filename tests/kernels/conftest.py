import contextlib

import pytest
import torch


@pytest.fixture
def threads():
    """`with threads(n):` runs a block with torch.set_num_threads(n); the count is restored after."""
    original = torch.get_num_threads()

    @contextlib.contextmanager
    def _set(n: int):
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(original)

    yield _set
    torch.set_num_threads(original)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
