import contextlib
import importlib
import os
import sys

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

def _import_interpreted(name):
    """`name` imported under TRITON_INTERPRET=1 (kernels run on CPU tensors), then taken out of
    sys.modules and the environment restored, so later imports (the dispatch tables', vLLM
    engines') get the compiled module."""
    package, _, attr = name.rpartition(".")
    saved_env, saved_module = os.environ.get("TRITON_INTERPRET"), sys.modules.pop(name, None)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)
        if saved_module is not None:
            sys.modules[name] = saved_module
            setattr(sys.modules[package], attr, saved_module)
        else:
            delattr(sys.modules[package], attr)
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


@pytest.fixture(scope="session")
def import_interpreted():
    """import_interpreted(module_name) -> the Triton kernel module compiled for the interpreter."""
    return _import_interpreted
