import pytest
import torch

from vexact_vllm.kernels import (
    backend_for,
    disable_reference_mode,
    enable_reference_mode,
    is_reference_mode_enabled,
    reference_mode,
)


def test_cpu_uses_torch():
    assert backend_for(torch.zeros(1)) == "torch"
    with reference_mode():
        assert backend_for(torch.zeros(1)) == "torch"


def test_enable_disable_symmetric():
    assert not is_reference_mode_enabled()
    enable_reference_mode()
    try:
        assert is_reference_mode_enabled()
    finally:
        disable_reference_mode()
    assert not is_reference_mode_enabled()


def test_context_manager_restores_on_error():
    with pytest.raises(RuntimeError):
        with reference_mode():
            assert is_reference_mode_enabled()
            raise RuntimeError("boom")
    assert not is_reference_mode_enabled()
    enable_reference_mode()
    try:
        with reference_mode(False):
            assert not is_reference_mode_enabled()
        assert is_reference_mode_enabled()
    finally:
        disable_reference_mode()
