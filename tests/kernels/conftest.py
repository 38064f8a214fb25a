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

@pytest.fixture(scope="session")
def import_interpreted(interpreted_modules):
    """import_interpreted(module_name) -> the Triton kernel module compiled for the interpreter
    (tests/conftest.py's `import_interpreted_modules`: later imports get the compiled module)."""
    return lambda name: interpreted_modules((name,))[0]
