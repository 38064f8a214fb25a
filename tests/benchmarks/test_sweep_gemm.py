"""benchmarks/sweep_gemm.py's `propose` on CPU: per `_TUNED` bucket, the fastest candidate a card's own
tiles may take, only where it beats today's tiles by the margin (the sweep itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

_BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def sweep(load_script):
    return load_script("sweep_gemm")


def _row(config, speeds, n=64, k=256):
    return {"n": n, "k": k, "config": config, "speed": dict(zip((1, 16, 64, 128, 4096), speeds)), "tag": ""}


def test_propose_picks_per_bucket_and_respects_the_card_rules(sweep):
    from vexact_vllm.kernels.gemm.linear_triton import GemmConfig as C
    from vexact_vllm.kernels.gemm.linear_triton import check_tiles_on

    tuned = {
        (_BF16, 64, 256): ((64, C(64, 32, 64, 8, 4, 8, 1)), (128, C(64, 32, 64, 8, 4, 6, 3)), (None, C(128, 128, 64, 8, 8, 3))),
        (torch.float32, 64, 256): ((None, C(64, 64, 32, 8, 4, 3)),),
    }  # fmt: skip
    a = (64, 32, 128, 8, 4, 6, 1)  # best at M <= 64
    b = (64, 64, 128, 8, 4, 6, 1)  # best at M = 128
    split = (64, 64, 64, 8, 4, 6, 1, False, False, 2, True)  # fastest everywhere, but another k_split
    close = (64, 64, 64, 8, 4, 4, 1)  # 2% over today's at M = 4096: within the margin
    rows = [
        _row(None, (0.90, 0.90, 0.80, 0.70, 0.95)),
        _row(a, (0.95, 1.00, 0.85, 0.50, 0.30)),
        _row(b, (0.50, 0.50, 0.50, 0.90, 0.40)),
        _row(split, (2.0, 2.0, 2.0, 2.0, 2.0)),
        _row(close, (0.1, 0.1, 0.1, 0.1, 0.969)),
        _row(a, (0.2, 0.2, 0.2, 0.2, 0.2), n=128),  # another shape's row
    ]
    picks = sweep.propose(rows, tuned)
    assert set(picks) == {(64, 256)} and set(picks[(64, 256)]) == {64, 128}
    cand, new, old = picks[(64, 256)][64]
    assert cand == a and new == [0.95, 1.00, 0.85] and old == [0.90, 0.90, 0.80]
    assert picks[(64, 256)][128][0] == b
    check_tiles_on({"X": {(_BF16, 64, 256): {bound: C(*c) for bound, (c, _, _) in picks[(64, 256)].items()}}}, tuned)
    assert sweep.propose(rows, tuned, margin=0.2) == {(64, 256): {128: (b, [0.90], [0.70])}}
    assert sweep.propose([r for r in rows if r["config"] is not None], tuned) == {}  # nothing to compare with
