"""`gc_paused`: the cycle collector runs before a capture, stays off inside, and comes back as it was."""

import gc

from vexact_vllm.kernels.capture import gc_paused


class _Cycle:
    def __init__(self):
        self.me = self


def test_collects_first_and_pauses_inside():
    was = gc.isenabled()
    gc.enable()
    try:
        _Cycle()  # unreachable, freed only by the cycle collector
        with gc_paused():
            assert not any(isinstance(o, _Cycle) for o in gc.get_objects())
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()


def test_leaves_a_disabled_collector_disabled():
    was = gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()
