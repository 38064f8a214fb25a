"""Pick the GEMM tiles per weight shape (N, K) and M bucket: a sweep against cuBLAS.

The batch-invariant GEMM (kernels/gemm/linear_triton.py) uses ONE reduction (BLOCK_K) per (N, K, dtype),
whatever M is; only the tile (and pointer vs TMA loads) may follow M. For each shape this prints, per candidate, the speed vs cuBLAS (F.linear, bf16
out; the lm_head writes fp32 like ours) at each M, timed as CUDA-graph replays, and the geometric
mean over M; the best candidate per shape comes last. `_TUNED` holds a tile per M bucket for each
shape, all sharing one BLOCK_K (kernels/gemm/linear_triton.py): pick them from the per-M columns.

    python3 benchmarks/sweep_gemm.py [--shapes qwen3-1.7b,qwen3-8b] [--ms 64,256,512,2048,8192] [--json FILE]
    python3 benchmarks/sweep_gemm.py --small --ms 64,128,256,512   # the small-M (decode) tiles only
    python3 benchmarks/sweep_gemm.py --narrow --tma --ms 1,16,32,64,128   # 16/32-wide decode tiles
    python3 benchmarks/sweep_gemm.py --split [--only prefill]   # K in two parts (k_split = 2) on the narrow weights
    python3 benchmarks/sweep_gemm.py --narrow --tma --cold --ms 1,16,64,128   # weights read from HBM
    python3 benchmarks/sweep_gemm.py --narrow --any-k --cold --ms 1,16,64,128  # a card's own tiles (_TUNED_ON)

`--cold` times every call on one of several copies of the weight, more bytes in all than the L2
holds (COLD_BYTES), in turn, as the model runs them (each layer's weights come from HBM); without
it one weight is replayed and stays in the L2 (25 MB of a 50 MB L2), which favours other tiles.

Needs CUDA. Changing a `_TUNED` entry changes the bits of that shape on both sides alike.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

# Weight shapes (N, K) of the fused projections: qkv, o, gate_up, down, lm_head.
SHAPES = {
    "qwen3-1.7b": [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (151936, 2048)],
    "qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)],
}
# (block_m, block_n, block_k, group_m, num_warps, num_stages, programs_per_sm)
CANDIDATES = [
    (64, 128, 64, 8, 4, 3, 2),
    (64, 128, 64, 8, 4, 4, 1),
    (64, 64, 128, 8, 4, 4, 1),
    (64, 256, 64, 8, 8, 3, 1),
    (128, 64, 64, 8, 4, 4, 1),
    (128, 128, 64, 8, 4, 4, 1),
    (128, 128, 64, 8, 8, 4, 1),
    (128, 128, 64, 8, 8, 5, 1),
    (128, 256, 64, 8, 8, 3, 1),
    (128, 128, 128, 8, 8, 3, 1),
]

# Small-M (decode) tiles for `--small`: each shape tries only those sharing its `_TUNED` BLOCK_K (the
# reduction order is fixed per shape; the small-M tile may change only how the work is split).
SMALL_CANDIDATES = [
    (64, 32, 64, 8, 4, 6, 2),
    (64, 64, 64, 8, 4, 4, 1),
    (64, 64, 64, 8, 4, 5, 1),
    (64, 64, 64, 8, 4, 4, 2),
    (64, 128, 64, 8, 4, 3, 2),
    (64, 128, 64, 8, 4, 4, 1),
    (64, 128, 64, 8, 4, 5, 1),
    (64, 128, 64, 8, 8, 4, 1),
    (64, 256, 64, 8, 4, 4, 1),
    (64, 256, 64, 8, 8, 3, 1),
    (128, 64, 64, 8, 4, 5, 1),
    (128, 64, 64, 8, 8, 4, 1),
    (128, 128, 64, 8, 4, 5, 1),
    (128, 128, 64, 8, 8, 5, 1),
    (128, 128, 64, 8, 8, 4, 2),
    (128, 256, 64, 8, 8, 3, 1),
    (64, 32, 128, 8, 4, 4, 2),
    (64, 64, 128, 8, 4, 3, 2),
    (64, 64, 128, 8, 4, 4, 1),
    (64, 128, 128, 8, 4, 3, 1),
    (128, 64, 128, 8, 4, 3, 1),
    (128, 128, 128, 8, 8, 3, 1),
]

# Narrow column tiles for `--narrow` (decode, M <= 64-128): a weight of N <= 4096 columns gives only
# N / BLOCK_N programs, so 16- and 32-wide tiles (wgmma n = 16/32) put a slice of W on every SM, with
# deep pipelines to keep each SM's loads in flight. Same BLOCK_K filter as `--small`.
NARROW_CANDIDATES = [
    (64, 16, 64, 8, 4, 8, 1),
    (64, 16, 64, 8, 4, 6, 2),
    (64, 16, 64, 8, 4, 12, 1),
    (64, 32, 64, 8, 4, 8, 1),
    (64, 32, 64, 8, 4, 5, 2),
    (64, 32, 64, 8, 4, 4, 3),
    (64, 16, 128, 8, 4, 6, 1),
    (64, 16, 128, 8, 4, 4, 2),
    (64, 16, 128, 8, 4, 8, 1),
    (64, 32, 128, 8, 4, 6, 1),
    (64, 32, 128, 8, 4, 3, 2),
    # second round (2026-11-24): more programs per SM (concurrent tiles hide load latency)
    (64, 32, 64, 8, 4, 4, 4),
    (64, 32, 64, 8, 4, 3, 4),
    (64, 32, 64, 8, 4, 6, 3),
    (64, 16, 64, 8, 4, 4, 3),
    (64, 16, 64, 8, 4, 4, 4),
    (64, 64, 64, 8, 4, 4, 3),
    (64, 64, 64, 8, 4, 3, 4),
    (64, 16, 128, 8, 4, 4, 3),
    (64, 16, 128, 8, 4, 3, 4),
    (64, 32, 128, 8, 4, 3, 3),
    (64, 32, 128, 8, 4, 4, 3),
    (64, 32, 128, 8, 4, 2, 4),
    # third round (2026-11-28, H200): more weight bytes in flight per SM (the H200 reads 4.8 TB/s)
    (64, 32, 64, 8, 4, 8, 2),
    (64, 32, 64, 8, 4, 12, 1),
    (64, 64, 64, 8, 4, 6, 2),
    (64, 64, 64, 8, 4, 8, 1),
    (64, 16, 64, 8, 4, 12, 2),
    # fourth round (2026-11-28): BLOCK_K 128-256 (the GPU's bits do not depend on BLOCK_K, so a card's
    # own tiles may take another one: `--any-k`); more weight bytes per K step
    (64, 32, 128, 8, 4, 8, 1),
    (64, 64, 128, 8, 4, 6, 1),
    (64, 64, 128, 8, 4, 4, 2),
    (64, 128, 128, 8, 4, 4, 1),
    (64, 32, 256, 8, 4, 4, 1),
    (64, 64, 256, 8, 4, 3, 1),
]


# `--split`: K in two equal parts (GemmConfig.k_split = 2, a different reduction for the weight shape,
# the same on both sides), on the weights whose few column tiles leave SMs idle at decode sizes. The
# decode candidates compute the parts in separate programs (measured at SPLIT_SMALL_MS); the prefill
# candidates sum both in one program, two accumulators (measured at SPLIT_LARGE_MS). Same BLOCK_K filter.
# The 8B down and qkv are here because an H200 profile put the 8B GEMMs at M = 16 at 1.24x stock's time.
SPLIT_SHAPES = [(4096, 2048), (2048, 2048), (2048, 6144), (4096, 4096), (4096, 12288), (6144, 4096)]
SPLIT_SMALL_MS = [1, 16, 32, 64, 128, 256]
SPLIT_LARGE_MS = [128, 256, 512, 2048, 8192]
_SPLIT_PROGRAMS = (False, False, 2, True)  # tma, warp_specialize, k_split, split_programs
_SPLIT_ONE = (2, False)  # k_split, split_programs
SPLIT_SMALL_CANDIDATES = [
    (*tile, *_SPLIT_PROGRAMS)
    for bk in (64, 128)
    for tile in (
        (64, 16, bk, 8, 4, 3, 1), (64, 16, bk, 8, 4, 4, 1), (64, 16, bk, 8, 4, 6, 1),
        (64, 32, bk, 8, 4, 3, 1), (64, 32, bk, 8, 4, 4, 1), (64, 32, bk, 8, 4, 6, 1),
        (64, 64, bk, 8, 4, 3, 1), (64, 64, bk, 8, 4, 4, 1), (128, 64, bk, 8, 4, 3, 1),
        (64, 16, bk, 8, 4, 8, 1), (64, 32, bk, 8, 4, 8, 1), (64, 64, bk, 8, 4, 6, 1),
        (128, 64, bk, 8, 4, 4, 1), (128, 128, bk, 8, 8, 3, 1), (64, 128, bk, 8, 4, 4, 1),
    )
]  # fmt: skip
SPLIT_LARGE_CANDIDATES = [
    (*tile, *_SPLIT_ONE)
    for bk in (64, 128)
    for tile in (
        (64, 32, bk, 8, 4, 4, 3, False, False), (64, 64, bk, 8, 4, 4, 1, True, True),
        (64, 64, bk, 8, 4, 3, 2, False, False), (64, 128, bk, 8, 4, 4, 1, True, True),
        (64, 128, bk, 8, 4, 4, 1, True, False), (128, 64, bk, 8, 4, 4, 1, True, False),
        (128, 128, bk, 8, 8, 3, 1, True, False), (128, 128, bk, 8, 8, 4, 1, True, True),
        (128, 128, bk, 8, 4, 3, 1, True, False), (128, 128, bk, 8, 8, 3, 1, False, False),
    )
]  # fmt: skip


DEFAULT_MS = "64,256,512,2048,8192"  # --ms when not given (every mode but --split)

# `--cold`: weight copies per shape, at least this many bytes in all (4x the H100's 50 MB L2).
COLD_BYTES = 200 * 2**20


def _bench(fn, x, weights) -> float:
    """ms per call of fn(x, w), the calls cycling through `weights` (one CUDA graph replays them all)."""
    from triton.testing import do_bench_cudagraph

    from vexact_vllm.kernels.capture import gc_paused

    with gc_paused():
        return do_bench_cudagraph(lambda: [fn(x, w) for w in weights], rep=20) / len(weights)


def sweep(
    shapes, ms, candidates, small_only: bool = False, tag: str = "", cold: bool = False, any_k: bool = False
) -> list[dict]:
    import vexact_vllm.kernels.gemm.linear_triton as gt

    original = gt.gemm_config
    rows = []
    try:
        for n, k in shapes:
            out_dtype = torch.float32 if n > 100_000 else torch.bfloat16
            w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
            copies = -(-COLD_BYTES // w.nbytes) if cold else 1
            ws = [w] + [w.clone() for _ in range(copies - 1)]
            xs = {m: torch.randn(m, k, device="cuda").bfloat16() for m in ms}
            ours = lambda x, w, o=out_dtype: gt.linear_triton(x, w, None, o)  # noqa: E731
            base = {m: _bench(torch.nn.functional.linear, xs[m], ws) for m in ms}
            print(
                f"\n(N={n}, K={k}) cuBLAS us: " + " ".join(f"M={m}:{base[m] * 1e3:.1f}" for m in ms),
                flush=True,
            )
            print(
                f"{'candidate':28s}" + "".join(f"{'M=' + str(m):>9s}" for m in ms) + "    gmean", flush=True
            )
            buckets = gt._TUNED.get((torch.bfloat16, n, k))
            gt.gemm_config = original  # the table's own tiles (the previous shape left a candidate patched in)
            tuned = {m: base[m] / _bench(ours, xs[m], ws) for m in ms}
            print(f"{'tuned (today)':28s}" + "".join(f"{tuned[m]:9.2f}" for m in ms), flush=True)
            rows.append({"n": n, "k": k, "config": None, "speed": tuned, "tag": tag})  # what `propose` must beat
            for cand in candidates:
                if small_only and not any_k and buckets is not None and cand[2] != buckets[0][1].block_k:
                    continue  # another reduction order than the shape's: not a small-M tile for it
                cfg = gt.GemmConfig(*cand)
                gt.gemm_config = lambda *_, cfg=cfg: cfg
                try:
                    speed = {m: base[m] / _bench(ours, xs[m], ws) for m in ms}
                except Exception as e:  # noqa: BLE001 - a candidate that does not fit is skipped
                    print(f"{str(cand):28s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                gmean = math.exp(sum(math.log(s) for s in speed.values()) / len(speed))
                rows.append(
                    {"n": n, "k": k, "config": list(cand), "speed": speed, "gmean": gmean, "tag": tag}
                )
                print(
                    f"{str(cand):28s}" + "".join(f"{speed[m]:9.2f}" for m in ms) + f"{gmean:9.2f}", flush=True
                )
            del w, ws, xs
            torch.cuda.empty_cache()
    finally:
        gt.gemm_config = original
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", default="qwen3-1.7b,qwen3-8b", help=f"comma-separated of {', '.join(SHAPES)}"
    )
    parser.add_argument("--ms", help=f"comma-separated M values (default {DEFAULT_MS}; --split: its own two lists)")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument(
        "--small",
        action="store_true",
        help="small-M tiles sharing each tuned shape's BLOCK_K (decode bucket)",
    )
    parser.add_argument(
        "--narrow", action="store_true", help="only the narrow decode tiles (NARROW_CANDIDATES)"
    )
    parser.add_argument(
        "--tma", action="store_true", help="each candidate also with TMA loads, and with warp specialization"
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="K in two parts (k_split = 2) on SPLIT_SHAPES: decode and prefill tiles",
    )
    parser.add_argument(
        "--any-k",
        action="store_true",
        help="--small/--narrow: also candidates of another BLOCK_K than the shape's (for a card's own "
        "tiles, _TUNED_ON: bf16 bits do not depend on BLOCK_K on the GPU)",
    )
    parser.add_argument(
        "--only", choices=("decode", "prefill"), help="--split: only the decode or only the prefill candidates"
    )
    parser.add_argument(
        "--cold", action="store_true", help=f"cycle through weight copies ({COLD_BYTES >> 20} MB in all): HBM reads"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: the GEMM sweep needs a CUDA device")
    from vexact_vllm.kernels.gemm.linear_triton import gemm_config
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    if args.narrow:  # the lm_head has columns enough for every SM
        shapes = [(n, k) for n, k in shapes if n < 100_000]
    ms = [int(m) for m in (args.ms or DEFAULT_MS).split(",")]
    start = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {'cold (HBM)' if args.cold else 'L2-hot'} weights", flush=True)
    if args.split:
        shapes = [s for s in shapes if s in SPLIT_SHAPES]
        small_ms, large_ms = (ms, ms) if args.ms else (SPLIT_SMALL_MS, SPLIT_LARGE_MS)
        rows = []
        if args.only != "prefill":
            rows += sweep(shapes, small_ms, SPLIT_SMALL_CANDIDATES, small_only=True, tag="decode", cold=args.cold)
        if args.only != "decode":
            rows += sweep(shapes, large_ms, SPLIT_LARGE_CANDIDATES, small_only=True, tag="prefill", cold=args.cold)
    else:
        if args.narrow or args.small:  # one-part candidates: shapes tuned with K in two parts take --split
            shapes = [(n, k) for n, k in shapes if gemm_config(n, k, torch.bfloat16).k_split == 1]
        candidates = NARROW_CANDIDATES if args.narrow else SMALL_CANDIDATES if args.small else CANDIDATES
        if args.tma:  # GemmConfig's tma and warp_specialize fields after the seven above
            candidates = [*candidates, *((*c, True) for c in candidates), *((*c, True, True) for c in candidates)]
        rows = sweep(shapes, ms, candidates, small_only=args.small or args.narrow, cold=args.cold, any_k=args.any_k)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    _print_best(shapes, rows, start)
    _print_proposal(rows)


def _print_best(shapes, rows, start: float) -> None:
    """The best candidate per shape (and per tag: decode / prefill), by the geometric mean over M."""
    print(
        f"\nbest per shape (geometric mean of the speed over its M values); sweep {time.time() - start:.0f} s"
    )
    for n, k in shapes:
        for tag in sorted({r["tag"] for r in rows}):
            mine = [r for r in rows if (r["n"], r["k"]) == (n, k) and r["tag"] == tag and r["config"]]
            best = max(mine, key=lambda r: r["gmean"], default=None)
            if best is not None:
                speeds = " ".join(f"M={m}:{v:.2f}" for m, v in best["speed"].items())
                print(
                    f"    (_BF16, {n}, {k}) {tag}: {tuple(best['config'])}  # {speeds} (gmean {best['gmean']:.2f})"
                )


def propose(rows, tuned_table: dict, margin: float = 0.03) -> dict:
    """{(N, K): {bucket bound: (candidate, its speeds, today's speeds)}}: for each `_TUNED` bucket with
    measured M values inside it, the candidate with the best geometric mean there, where it beats
    today's tiles (the "tuned" row, this card's) by more than `margin`. Only candidates a card's own
    tiles may take: those `linear_triton.check_tiles_on` accepts in that bucket."""
    import vexact_vllm.kernels.gemm.linear_triton as gt

    out = {}
    for (dtype, n, k), buckets in tuned_table.items():
        if dtype != torch.bfloat16:  # the sweep's weights are bf16
            continue
        mine = [r for r in rows if (r["n"], r["k"]) == (n, k)]
        today = {m: v for r in mine if r["config"] is None for m, v in r["speed"].items()}
        low = 0
        for bound, _ in buckets:
            ms = sorted(m for m in today if m > low and (bound is None or m <= bound))
            low = math.inf if bound is None else bound
            if not ms:
                continue

            def gmean(speed, ms=ms):
                return math.exp(sum(math.log(speed[m]) for m in ms) / len(ms))

            best = None
            for r in mine:
                if r["config"] is None or any(m not in r["speed"] for m in ms):
                    continue
                try:
                    gt.check_tiles_on({"card": {(dtype, n, k): {bound: gt.GemmConfig(*r["config"])}}}, tuned_table)
                except AssertionError:
                    continue
                if best is None or gmean(r["speed"]) > gmean(best["speed"]):
                    best = r
            if best is not None and gmean(best["speed"]) > (1 + margin) * gmean(today):
                out.setdefault((n, k), {})[bound] = (
                    tuple(best["config"]),
                    [best["speed"][m] for m in ms],
                    [today[m] for m in ms],
                )
    return out


def _print_proposal(rows) -> None:
    """`propose`'s picks as `_TUNED_ON` lines for this card (kernels/gemm/linear_triton.py)."""
    import vexact_vllm.kernels.gemm.linear_triton as gt

    picks = propose(rows, gt._TUNED)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "this card"
    print(f"\n_TUNED_ON entries for {name} (buckets whose best candidate beats today's tiles by > 3%):")
    for (n, k), by_bound in picks.items():
        tiles = ", ".join(f"{bound}: C{cand}" for bound, (cand, _, _) in by_bound.items())
        notes = "; ".join(
            f"{bound}: " + " ".join(f"{v:.2f}" for v in new) + " (" + " ".join(f"{v:.2f}" for v in old) + ")"
            for bound, (_, new, old) in by_bound.items()
        )
        print(f"    (_BF16, {n}, {k}): {{{tiles}}},  # {notes}")


if __name__ == "__main__":
    main()
