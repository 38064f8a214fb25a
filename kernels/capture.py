"""CUDA-graph capture with Python's cycle collector paused, as vLLM's own capture does.

A cycle collected while a stream is capturing can free what a graph being captured (or one captured
before) still refers to: on the H100 with Triton 3.6, `do_bench_cudagraph` of the paged decode at
B=16 x 32,768 keys, run after the 8,192-key case in one process, replayed into an illegal address
every time; with the collector run before the capture and paused during it, never (and never in a
fresh process, nor eagerly). vLLM's model runner captures under `freeze_gc_for_cudagraph_capture`
for the same reason; our benchmarks and tests that capture graphs themselves use `gc_paused`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect now, keep the cycle collector off inside, restore its previous state after."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
