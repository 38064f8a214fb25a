"""Shared fixtures: tiny checkpoints built once per session in a temporary cache."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("vexact-cache")


@pytest.fixture(scope="session")
def tiny_model(tiny_cache):
    """build(arch) -> checkpoint path (qwen3 | qwen2 | llama), built once per arch."""
    from vexact_vllm.tiny_model import build_tiny_model

    built = {}

    def build(arch: str = "qwen3") -> str:
        if arch not in built:
            built[arch] = str(build_tiny_model(arch, path=tiny_cache / f"tiny-{arch}"))
        return built[arch]

    return build
