"""`vexact-vllm fuzz`: hunt flakes. Random checkpoints, prompts, sampling options and engine settings
(fuzz_cases.py); each case's compositions run `--rounds` times on one engine (state carried from
round to round) and once more on fresh engines (chunked prefill, preemption, eager), every generated
token is scored again by the trainer in several packings and compared with torch.equal.

Prints, last, what each case was (family and sizes, requests, engine settings) and its verdict, the
runs and failures per composition (the flake rate) and, for every failure, what
differed (with the in-process bisect's verdict: model/kernels or vLLM integration) and the command
that rebuilds exactly that case: `vexact-vllm fuzz --seed S --case I ... --compositions NAME`.
`--workers N` runs N cases at once, each in its own process (one GPU holds several small engines).
Exit 0 only when every run matched bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from .args import positive_int
from .fuzz_cases import FuzzCase, draw_case, prompt_ids

RECORD_PREFIX = "VEXACT_FUZZ "
PROFILE_DEFAULTS = {"cpu": 256, "cuda": 3000}  # default --max-prompt-len per profile


def _base(name: str) -> str:
    """'prefix-cache (195-token prefix) #1' -> 'prefix-cache'."""
    return name.split(" ")[0]


def _settings(case: FuzzCase, model_path: str, names: list[str]):
    from .check import kv_cache_bytes
    from .rollout import RolloutSettings

    prompts, prefix = prompt_ids(case)
    longest_out = max(max(o["max_tokens"] for o in case.per_request), case.block_size + 1)
    need = len(prefix) + max(map(len, prompts)) + 2 * longest_out + case.block_size
    max_model_len = -(-need // case.block_size) * case.block_size
    settings = RolloutSettings(
        model=model_path, max_model_len=max_model_len, max_tokens=case.per_request[0]["max_tokens"],
        seed=case.index * 1000 + 7, kv_cache_bytes=kv_cache_bytes(model_path, max_model_len),
        chunk_tokens=case.chunk_tokens, block_size=case.block_size,
        shared_prefix=prefix if "prefix-cache" in names else [], per_request=case.per_request, extra=case.engine,
    )  # fmt: skip
    return prompts, settings


def run_case(
    case: FuzzCase, rounds: int, workdir: Path, only: list[str] | None = None, keep: bool = False,
    engine_extra: dict | None = None,
) -> list[dict]:
    """Every composition run of one case, as records (see `_record`); the checkpoint is deleted
    afterwards unless a run failed or `keep`. `engine_extra`: LLM(...) arguments of the run, not of
    the case (e.g. gpu_memory_utilization when several cases share a GPU)."""
    import random

    import torch
    from transformers import AutoTokenizer

    from vexact_vllm.tiny_model import build_random_model

    from .check import bisect_note, score_rows
    from .rollout import run_compositions
    from .score import load_trainer

    names = [c for c in case.compositions if only is None or c in only]
    path = workdir / f"case-{case.seed}-{case.index}"
    build_random_model(case.model_type, case.fields, path, seed=case.index, std=case.weight_std, force=True)
    case.tokenizer_len = len(AutoTokenizer.from_pretrained(str(path)))
    prompts, settings = _settings(case, str(path), names)
    settings.extra = {**settings.extra, **(engine_extra or {})}
    results = run_compositions(prompts, settings, names, rounds=rounds)
    trainer = load_trainer(str(path), torch.bfloat16)
    packings = [1, 0, random.Random(case.index).choice((2, 3, 5))]
    rows = score_rows(trainer, [("vexact", r) for r in results], packings)
    bisect = bisect_note(trainer, [("vexact", r) for r in results], rows, forced=False)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    records = [_record(case, row, bisect) for row in rows]
    if keep or any(not r["passed"] for r in records):
        records[0]["checkpoint"] = str(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
    return records


def _record(case: FuzzCase, row, bisect: str | None) -> dict:
    c = row.comparison
    first = None if c.first is None else c.first.describe()
    return {
        "case": case.index, "seed": case.seed, "composition": _base(row.composition), "run": row.composition,
        "passed": c.mismatches == 0, "inconclusive": row.problem is not None, "tokens": c.tokens,
        "mismatches": c.mismatches, "max_abs_diff": c.max_abs_diff, "first": first, "per_packing": row.per_packing,
        "problem": row.problem, "notes": row.notes, "bisect": bisect if c.mismatches else None,
        "describe": case.describe(), "case_parts": case.describe_parts(),
        "model": case.model_summary(), "engine": case.engine_summary(),
    }  # fmt: skip


def _error_record(case: FuzzCase, error: str) -> dict:
    return {"case": case.index, "seed": case.seed, "composition": "(case)", "run": "(case)", "passed": False,
            "error": error, "describe": case.describe(), "case_parts": case.describe_parts(),
            "model": case.model_summary(), "engine": case.engine_summary()}  # fmt: skip


def reproducer(args, record: dict) -> str:
    cmd = ["vexact-vllm", "fuzz", "--seed", str(record["seed"]), "--case", str(record["case"]),
           "--profile", args.profile, "--max-prompt-len", str(args.max_prompt_len), "--rounds", str(args.rounds)]  # fmt: skip
    if record["composition"] != "(case)":
        cmd += ["--compositions", record["composition"]]
    return " ".join(cmd)


def summary(records: list[dict]) -> list[tuple[str, int, int, int]]:
    """(composition, runs, failures, inconclusive) per composition, in first-seen order, then the
    total. Inconclusive: every token matched but the run tested nothing (no preemption or no cache
    hit happened with this case's settings); not a failure of the contract."""
    runs, fails, idle = Counter(), Counter(), Counter()
    for r in records:
        runs[r["composition"]] += 1
        fails[r["composition"]] += not r["passed"]
        idle[r["composition"]] += bool(r.get("inconclusive")) and r["passed"]
    rows = [(name, runs[name], fails[name], idle[name]) for name in runs]
    return rows + [("total", sum(runs.values()), sum(fails.values()), sum(idle.values()))]


def case_lines(records: list[dict]) -> list[str]:
    """What each case was and how it went, in case order: its verdict, runs and tokens, then the
    checkpoint, the requests and the engine settings, one indented line each."""
    by_case: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        by_case.setdefault((r["seed"], r["case"]), []).append(r)
    lines = []
    for (seed, case), recs in sorted(by_case.items()):
        verdict = "PASS" if all(r["passed"] for r in recs) else "FAIL"
        idle = sum(bool(r.get("inconclusive")) and r["passed"] for r in recs)
        verdict += f" ({idle} inconclusive)" if idle else ""
        names = ", ".join(dict.fromkeys(r["run"].split(" #")[0] for r in recs))  # "batch #1" -> "batch"
        tokens = sum(r.get("tokens", 0) for r in recs)
        lines.append(f"case {case} (seed {seed}): {verdict}, {len(recs)} runs: {names}; {tokens} tokens")
        parts = recs[0].get("case_parts") or {"case": recs[0]["describe"]}
        lines += [f"  {name}: {text}" for name, text in parts.items()]
    return lines


def to_table(args, records: list[dict], cases: int, elapsed: float) -> str:
    lines = case_lines(records) + [""]
    lines += [f"{'composition':16s} {'runs':>6s} {'failures':>9s} {'flake rate':>11s} {'inconclusive':>13s}"]
    for name, n, f, idle in summary(records):
        lines.append(f"{name:16s} {n:6d} {f:9d} {f / n if n else 0.0:11.4f} {idle:13d}")
    failed = [r for r in records if not r["passed"]]
    for r in failed:
        lines.append(f"FAIL case {r['case']} (seed {r['seed']}), {r['run']}")
        if r.get("error"):
            lines.append(f"  error: {r['error']}")
        else:
            lines.append(f"  {r['mismatches']} of {r['tokens']} tokens differ (max |diff| {r['max_abs_diff']:.3g}; "
                         f"per packing {r['per_packing']}); first: {r['first']}" + (f"; {r['problem']}" if r["problem"] else ""))  # fmt: skip
            if r.get("bisect"):
                lines.append(f"  bisect: {r['bisect']}")
        lines.append(f"  reproduce: {reproducer(args, r)}")
    verdict = "PASS: every run matched bit for bit" if not failed else f"FAIL: {len(failed)} failing runs"
    lines.append(f"{verdict} ({cases} cases, {len(records)} composition runs, {elapsed:.0f} s)")
    return "\n".join(lines)


def _case_in_child(args, index: int) -> list[dict]:
    """One case in its own process (--workers): its records from the child's stdout."""
    cmd = [sys.executable, "-m", "vexact_vllm.cli", "fuzz", "--case", str(index), "--records", *_forwarded(args)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # its logs go to our stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RECORD_PREFIX)]
    if not lines:
        case = draw_case(args.seed, index, args.profile, args.max_prompt_len)
        return [_error_record(case, f"the case's process exited {proc.returncode} without a result; see its log")]
    return json.loads(lines[-1].removeprefix(RECORD_PREFIX))


def _forwarded(args) -> list[str]:
    out = ["--seed", str(args.seed), "--profile", args.profile, "--max-prompt-len", str(args.max_prompt_len),
           "--rounds", str(args.rounds), "--workdir", str(args.workdir)]  # fmt: skip
    if args.gpu_memory_utilization is not None:
        out += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.compositions:
        out += ["--compositions", ",".join(args.compositions)]
    return out + (["--keep"] if args.keep else [])


def _case_here(args, index: int) -> list[dict]:
    case = draw_case(args.seed, index, args.profile, args.max_prompt_len)
    try:
        extra = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
        return run_case(case, args.rounds, Path(args.workdir), args.compositions, args.keep, extra)
    except Exception as e:  # an engine or trainer error fails this case; the others still run
        traceback.print_exc(file=sys.stderr)
        return [_error_record(case, f"{type(e).__name__}: {e}")]


def run_fuzz(args) -> int:
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from .console import diagnostics_to_stderr

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if args.profile is None:
        import torch

        args.profile = "cuda" if torch.cuda.is_available() else "cpu"
    if args.max_prompt_len is None:
        args.max_prompt_len = PROFILE_DEFAULTS[args.profile]
    if args.workdir is None:
        args.workdir = tempfile.mkdtemp(prefix="vexact-fuzz-")
    indices = [args.case] if args.case is not None else list(range(args.start, args.start + args.cases))
    if args.workers > 1 and args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = round(0.6 / args.workers, 3)  # vLLM checks this much is free at start
    t0 = time.perf_counter()
    records: list[dict] = []

    def done(index: int, recs: list[dict]) -> None:  # every finished case is written at once
        records.extend(recs)
        if args.output:
            Path(args.output).write_text(json.dumps({"args": _forwarded(args), "records": records}, indent=1) + "\n")
        print(f"fuzz: case {index} done ({sum(not r['passed'] for r in records)} failing runs so far, "
              f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip

    with diagnostics_to_stderr():
        if args.records:  # a --workers child: one case, its records on stdout (restored below)
            records = _case_here(args, indices[0])
        elif args.workers > 1:
            with ThreadPoolExecutor(args.workers) as pool:
                futures = {pool.submit(_case_in_child, args, i): i for i in indices}
                for future in as_completed(futures):
                    done(futures[future], future.result())
        else:
            for i in indices:
                done(i, _case_here(args, i))
    if args.records:
        print(RECORD_PREFIX + json.dumps(records), flush=True)
        return 0
    report = to_table(args, records, len(indices), time.perf_counter() - t0)
    print(json.dumps({"passed": all(r["passed"] for r in records), "summary": summary(records), "records": records})
          if args.json else report, flush=True)  # fmt: skip
    return 0 if all(r["passed"] for r in records) else 1


def _compositions(text: str) -> list[str]:
    from .check import COMPOSITIONS

    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted(set(names) - set(COMPOSITIONS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown composition(s) {unknown}; choose from {', '.join(COMPOSITIONS)}")
    return names


def add_arguments(parser) -> None:
    parser.add_argument("--cases", type=positive_int, default=4, help="random cases to draw (case indices from --start)")
    parser.add_argument("--start", type=int, default=0, help="index of the first case")
    parser.add_argument("--case", type=int, help="run only this case index (a failure's reproducer; default: --cases from --start)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed: with the index it fixes each case")
    parser.add_argument("--profile", choices=("cpu", "cuda"), help="size limits of the drawn cases (default: the device)")
    parser.add_argument("--max-prompt-len", type=positive_int,
                        help=f"longest prompt drawn (default: {PROFILE_DEFAULTS['cpu']} cpu, {PROFILE_DEFAULTS['cuda']} cuda)")
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="times the shared-engine compositions run in a row on one engine")
    parser.add_argument("--compositions", type=_compositions, help="only these compositions (comma-separated; default: each case's own draw)")
    parser.add_argument("--workers", type=positive_int, default=1, help="cases run at once, each in its own process")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="vLLM's, per engine (default: vLLM's; 0.6 / --workers with several workers)")
    parser.add_argument("--workdir", help="where checkpoints are built (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep every checkpoint (failing ones are always kept)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    parser.add_argument("--output", help="also write every record as JSON to this file (default: none)")
    parser.add_argument("--records", action="store_true", help=argparse.SUPPRESS)  # a --workers child
