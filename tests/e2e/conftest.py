"""Fixtures for the end-to-end tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def workers_before_shutdown(monkeypatch):
    """workers_before_shutdown(fn) -> a list that fills, for each vLLM engine `vexact-vllm check` starts in
    the test, with `llm.collective_rpc(fn)` (every worker's answer), asked just before the check shuts that
    engine down: one multiprocess engine (tens of seconds to start on CPU) serves both the check and the
    test's look into its workers."""
    import cloudpickle

    from vexact_vllm.cli import rollout

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function

    def install(fn) -> list:
        cloudpickle.register_pickle_by_value(sys.modules[fn.__module__])  # the workers cannot import tests/
        answers: list = []
        shutdown = rollout.shutdown_engine

        def ask_then_shut_down(llm) -> None:
            try:
                answers.append(llm.collective_rpc(fn))
            finally:
                shutdown(llm)

        monkeypatch.setattr(rollout, "shutdown_engine", ask_then_shut_down)
        return answers

    return install
