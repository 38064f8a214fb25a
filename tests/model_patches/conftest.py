"""Shared fixtures: the tiny checkpoints, one per family (built once per session, offline, in a tmp
dir), a loader for the stock and the vexact model, and a guard that the thread count does not leak
out of a test (the vexact classes' registration is reset for every test in tests/conftest.py)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from vexact_vllm.model_patches.trainers import transformers_hooks
from vexact_vllm.tiny_model import TINY_ARCHS


class _TinyPaths(dict):
    """arch -> checkpoint directory, each built on first use (a test builds only the families it loads)."""

    def __init__(self, build):
        super().__init__()
        self.build = build

    def __missing__(self, arch: str) -> Path:
        if arch not in TINY_ARCHS:
            raise KeyError(arch)
        self[arch] = path = Path(self.build(arch))
        return path


@pytest.fixture(scope="session")
def tiny_paths(tiny_model):
    """arch -> checkpoint directory (bf16 on disk), the session's shared tiny checkpoints."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield _TinyPaths(tiny_model)


@pytest.fixture
def load_model(tiny_paths):
    """load_model(arch, dtype, vexact) -> a fresh model in eval mode; vexact=False is stock transformers."""

    def _load(arch: str, dtype: torch.dtype, vexact: bool):
        if vexact:
            with transformers_hooks.installed():
                return AutoModelForCausalLM.from_pretrained(tiny_paths[arch], dtype=dtype).eval()
        return AutoModelForCausalLM.from_pretrained(tiny_paths[arch], dtype=dtype).eval()

    return _load


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests run on one thread: the torch reference kernels do many small reductions, and two OpenMP
    threads on a shared 2-core machine are 10x slower. Thread-count independence of the kernels is
    tested in tests/kernels; test_packed_invariance.py also scores one arrangement on two threads."""
    original = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(original)
