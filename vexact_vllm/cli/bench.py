"""`vexact-vllm bench`: stock vLLM, stock with VLLM_BATCH_INVARIANT=1, and vexact on one workload.

Each run of a configuration is its own process (VLLM_BATCH_INVARIANT is read at import), on the same
model and the same requests: random prompt token ids with lengths drawn from a range, a fixed number
of output tokens with `ignore_eos`, temperature and seed as given. One pass is one `generate` of the
whole workload, the prefix cache reset before it (untimed) so every pass does the same prefill work.
A run starts the engine (start-up: until it is ready), makes `--warmup-passes` untimed passes (so
every batch shape, prefill chunk and kernel variant the timed passes reach is compiled), then repeats
timed passes until `--duration` seconds of generation have accumulated (at least one pass) and
reports output tokens / timed seconds.

`--repeats` runs every configuration that many times, alternating the order (stock,
stock-batch-invariant, vexact; then reversed; ...) so neither side always runs first on a fresh
host; every run counts, the first included. The table, printed last, gives per configuration the
median output tok/s, min, max and spread, the median start-up, the ratios of medians to stock, and
each run's ratio to the stock run of the same repeat (`bench_report`). `--report` adds a markdown
section (date, device, commit, command, table); `--output` writes every run's numbers as JSON. All three
configurations run by default; without CUDA, stock-batch-invariant is left out (vLLM's
batch-invariant mode is Triton kernels). A run that fails is reported and the others still run
(exit 1). vLLM's logs, progress and each repeat's table go to stderr; stdout holds only the report.
`--profile DIR` adds one untimed pass per run under vLLM's torch profiler (engine steps chosen by
`--profile-steps`): where the time goes, per kernel, for each configuration (DIR/<configuration>).

Default workload: the built-in `qwen3-1.7b-shape`
(Qwen3-1.7B's config, 28 layers, hidden 2048, 16/8 heads of 128, vocabulary 151936) with dummy
weights (only its config is written: `--load-format dummy` never reads weights), 256 prompts of
64-511 random token ids below the vocabulary size, 256 output tokens, temperature 1, seed 7,
CUDA graphs on (vLLM's default); one warm-up pass, 20 s timed per run, 3 repeats. `--workload`
picks another request shape (`bench_workloads.py`: long, grpo, decode-small).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys

from .bench_engine import CONFIGS, DEFAULT_CONFIGS, EngineRun, checkpoint_line, profiler_dir, run_order
from .bench_interleave import run_interleaved, serve, shared_engine_kwargs
from .bench_report import git_commit, markdown_report, summarize, summary_table, to_table
from .bench_workloads import apply_workload, describe, for_workload, shared_max_model_len, workload_list


def run_one(args) -> dict:
    """One run of one configuration in this process; returns its measurements."""
    engine = EngineRun(args)
    warmup = engine.warm_up()
    record = {**engine.timed(), "warmup_s": warmup, "profile": None}
    if args.profile:  # one more pass, untimed, under vLLM's torch profiler (its engine-step window)
        engine.reset_prefix_cache()
        engine.llm.start_profile()
        engine.generate()
        engine.llm.stop_profile()
        record["profile"] = profile_table(profiler_dir(args))
    return record


def profile_table(directory: str, rows: int = 25) -> str | None:
    """The first `rows` operator rows of the table vLLM's profiler wrote into `directory` (sorted by
    device time on CUDA, by CPU time on CPU), or None if it wrote none."""
    import glob

    # profiler_out_0.txt from vLLM's GPU worker; its CPU worker names it rank0.profiler_out.txt
    found = sorted(glob.glob(os.path.join(directory, "*profiler_out*.txt")))
    if not found:
        print(f"note: vLLM's profiler wrote no table in {directory}", file=sys.stderr)
        return None
    with open(found[0]) as f:
        lines = f.read().splitlines()
    return "\n".join(lines[: rows + 3])


def profile_window(text: str) -> tuple[int, int]:
    """argparse type of --profile-steps: "SKIP:STEPS", engine steps skipped then profiled, STEPS >= 1."""
    try:
        skip, steps = (int(v) for v in text.split(":"))
    except ValueError:
        skip, steps = -1, 0
    if skip < 0 or steps < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: write SKIP:STEPS, e.g. 30:20 (SKIP >= 0, STEPS >= 1)")
    return skip, steps


def resolve_model(name: str, load_format: str) -> str:
    """A checkpoint directory, or a built-in name (without weights when they are dummy)."""
    from pathlib import Path

    from vexact_vllm.model_shapes import BUILTIN_MODELS
    from vexact_vllm.tiny_model import builtin_model

    if name in BUILTIN_MODELS:
        return builtin_model(name, weights=load_format != "dummy")
    if not (Path(name) / "config.json").is_file():
        raise SystemExit(f"error: {name} is neither a checkpoint directory nor a built-in model "
                         f"({', '.join(BUILTIN_MODELS)})")  # fmt: skip
    return name


def _vocab_size(model: str) -> int:
    """The checkpoint's vocabulary (a vision-language config.json keeps it in its text_config)."""
    from pathlib import Path

    config = json.loads((Path(model) / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def default_configs() -> list[str]:
    """DEFAULT_CONFIGS on CUDA. Elsewhere not stock-batch-invariant: vLLM's batch-invariant kernels
    are Triton kernels (it can still be asked for, as can the vexact A/B variants)."""
    import torch

    return [c for c in DEFAULT_CONFIGS if c != "stock-batch-invariant" or torch.cuda.is_available()]


def _config_names(args) -> list[str]:
    if args.configs is None:
        names = default_configs()
        if len(names) < len(DEFAULT_CONFIGS):
            print("note: no CUDA: leaving out stock-batch-invariant (VLLM_BATCH_INVARIANT needs Triton)",
                  file=sys.stderr)  # fmt: skip
    else:
        names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    return names


def _run_child(name: str, repeat: int, args) -> dict:
    """One run in a fresh process; its logs go to our stderr, its record comes back on its stdout."""
    cmd = [sys.executable, "-m", "vexact_vllm.cli", "bench", "--config", name, *args.forward]
    proc = subprocess.run(cmd, env={**os.environ, **CONFIGS[name]["env"]}, stdout=subprocess.PIPE, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("VEXACT_BENCH ")), None)
    if proc.returncode != 0 or line is None:
        print(f"error: configuration {name} (repeat {repeat}) failed (exit {proc.returncode}); see its log above",
              file=sys.stderr, flush=True)  # fmt: skip
        return {"config": name, "repeat": repeat, "failed": f"exit {proc.returncode}, see its log on stderr"}
    result = {**json.loads(line.removeprefix("VEXACT_BENCH ")), "repeat": repeat}
    print(f"{name} (repeat {repeat}): {result['output_tok_s']:.0f} output tok/s over {result['elapsed_s']:.1f} s "
          f"({result['passes']} passes), start-up {result['startup_s']:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    if result.get("profile"):
        print(f"{name} (repeat {repeat}) profile, in {args.profile}/{name}:\n{result['profile']}",
              file=sys.stderr, flush=True)  # fmt: skip
    return result


def _command_line(args) -> str:
    """How this was invoked: the real command line, or (when called as a function) every option."""
    if sys.argv[1:2] == ["bench"]:
        return shlex.join(["vexact-vllm", *sys.argv[1:]])
    shown = list(args.forward)
    shown[shown.index("--model") + 1] = args.model_name  # as given, not resolved
    shown += (["--configs", args.configs] if args.configs else []) + ["--repeats", str(args.repeats)]
    shown += ["--interleave"] if args.interleave else []
    return shlex.join(["vexact-vllm", "bench", *shown])


def settings_line(names: list[str]) -> str:
    """The VEXACT_* settings every configuration runs with, and those a configuration sets itself."""
    from vexact_vllm.kernels.settings import get_settings

    own = [f"{name} sets {' '.join(f'{k}={v}' for k, v in CONFIGS[name]['env'].items() if k.startswith('VEXACT_'))}"
           for name in names if any(k.startswith("VEXACT_") for k in CONFIGS[name]["env"])]  # fmt: skip
    return get_settings().describe() + "".join(f"; {o}" for o in own)


def run_bench(args) -> int:
    workloads = args.workload.split(",")
    if args.config:  # child process: it gets every field of a single workload on its command line
        if args.serve:
            return serve(args)
        apply_workload(args)
        print("VEXACT_BENCH " + json.dumps(run_one(args)), flush=True)
        return 0
    names = _config_names(args)
    try:  # the settings every configuration reads, checked before any engine starts
        from vexact_vllm.kernels.settings import refresh_settings

        refresh_settings()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if args.repeats < 1 or args.warmup_passes < 0 or args.duration < 0:
        raise SystemExit("error: --repeats must be at least 1, --warmup-passes and --duration at least 0")
    if args.interleave and args.profile:
        raise SystemExit("error: --profile runs each configuration in its own process; leave out --interleave")
    args.model_name = args.model
    args.model = resolve_model(args.model, args.load_format)
    if args.vocab_limit is None:
        args.vocab_limit = _vocab_size(args.model)
    if args.interleave and args.max_model_len is None:
        args.max_model_len = shared_max_model_len(workloads)  # one engine for all of them
    shared = shared_engine_kwargs(args.engine_kwargs, len(names))  # --interleave: each engine's share
    results: dict[str, list[dict]] = {}
    if args.interleave:  # children get the workloads' names and only the command line's overrides
        args.forward = forward_args(args)
        command = [sys.executable, "-m", "vexact_vllm.cli", "bench", *args.forward, "--engine-kwargs", shared]
        for record in run_interleaved(names, args, command, lambda name: CONFIGS[name]["env"], workloads):
            results.setdefault(record["workload"], []).append(record)
    reports = []
    for workload in workloads:
        one = for_workload(args, workload)
        one.forward = forward_args(one)
        reports.append(_bench_workload(one, names, results.get(workload), shared))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(reports[0] if len(reports) == 1 else {"workloads": reports}, f, indent=1)
    return 1 if any(r.get("failed") for report in reports for r in report["results"]) else 0


def _bench_workload(args, names: list[str], interleaved: list[dict] | None, shared: str) -> dict:
    """One workload: its runs (fresh processes, or the records `--interleave` already made), each
    repeat's table, the summary and --report on stdout; returns what --output saves."""
    results = list(interleaved or [])
    for position, (repeat, name) in enumerate(run_order(names, args.repeats)):  # a failure does not stop the rest
        if not args.interleave:
            results.append({**_run_child(name, repeat, args), "position": position})
        if position % len(names) == len(names) - 1:
            print(f"repeat {repeat}:\n{to_table(results[position + 1 - len(names) : position + 1])}",
                  file=sys.stderr, flush=True)  # fmt: skip
    workload = (f"{args.model_name} ({args.load_format} weights), {describe(args)}, temperature {args.temperature}, "
                f"seed {args.seed}"
                f"{', eager' if args.enforce_eager else ''}; {args.warmup_passes} warm-up pass(es), "
                f"{args.duration:g} s timed per run, {args.repeats} repeat(s) in alternating order"
                + (f"; engines side by side, gpu_memory_utilization {json.loads(shared)['gpu_memory_utilization']:g} each"
                   if args.interleave else ""))  # fmt: skip
    rows = summarize(results)
    meta = {"date": datetime.date.today().isoformat(), "command": _command_line(args), "commit": git_commit(),
            "workload": workload, "settings": settings_line(names), "engine": checkpoint_line(args.model, names),
            "device": next((r["device"] for r in results if "device" in r), "unknown")}  # fmt: skip
    print(workload)
    print(f"settings: {meta['settings']}")
    if meta["engine"]:
        print(f"engine arguments the checkpoint asks for: {meta['engine']}")
    print(summary_table(rows))
    if args.report:
        print("\n" + markdown_report(rows, meta))
    return {"model": args.model, "model_name": args.model_name, "workload": workload, "forwarded": args.forward,
            "results": results, "summary": rows, "order": names, "repeats": args.repeats, "duration_s": args.duration,
            "warmup_passes": args.warmup_passes, **meta}  # fmt: skip


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def length_range(text: str) -> str:
    """argparse type of --input-len: "LO-HI" (inclusive) or "N", 1 <= LO <= HI; returned as "LO-HI"."""
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length range: write LO-HI (e.g. 64-511) or N, 1 <= LO <= HI")
    return f"{lo}-{hi}"


def add_arguments(parser) -> None:
    from vexact_vllm.model_shapes import BUILTIN_MODELS, CONFIG_ONLY_SHAPES

    parser.add_argument("--model", default="qwen3-1.7b-shape",
                        help=f"checkpoint directory, or a built-in model: {', '.join(BUILTIN_MODELS)} (default: "
                        "qwen3-1.7b-shape; a shape's config only is written when --load-format is dummy; "
                        f"{', '.join(CONFIG_ONLY_SHAPES)}: dummy weights only)")
    parser.add_argument("--configs", help=f"comma-separated subset of {', '.join(CONFIGS)}, in the order of the "
                        "first repeat (default: stock, stock-batch-invariant, vexact; stock-batch-invariant only on "
                        "CUDA; the vexact-* variants change one speed-only choice, for A/B runs)")
    parser.add_argument("--workload", type=workload_list, default="default",
                        help="named request shapes (vexact_vllm/cli/bench_workloads.py): default (256 prompts of "
                        "64-511 tokens, 256 out), long (1-4k in, 4-8k out), grpo (64 prompts x 8 samples, 1-2k "
                        "out), decode-small (16 requests, 1k out); several, comma-separated, run one after another "
                        "(with --interleave on the same engines, started once, max-model-len the largest); the "
                        "options below override every listed workload's values; NAME:PROMPTS (grpo:32) sets one "
                        "workload's prompt count")
    parser.add_argument("--num-prompts", type=positive_int, help="prompts in one pass of the workload (default: the workload's)")
    parser.add_argument("--input-len", type=length_range, help="prompt length range LO-HI, inclusive, or one length N (default: the workload's)")
    parser.add_argument("--output-len", type=length_range,
                        help="output length range LO-HI (drawn per request), or one length N (default: the workload's)")
    parser.add_argument("--samples", type=positive_int, help="requests per prompt (same prompt, own seeds; default: the workload's)")
    parser.add_argument("--temperature", type=float, default=1.0, help="every request's")
    parser.add_argument("--seed", type=int, default=7, help="request i uses seed + i")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's --dtype")
    parser.add_argument("--max-model-len", type=positive_int, help="default: the workload's (1024 for default)")
    parser.add_argument("--load-format", default="dummy", help="dummy weights are fine for throughput")
    parser.add_argument("--vocab-limit", type=int,
                        help="prompt token ids are drawn from [10, this) (default: the model's vocab_size)")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="vLLM's tensor-parallel size, every configuration (one GPU per rank)")
    parser.add_argument("--pipeline-parallel-size", type=positive_int, default=1,
                        help="vLLM's pipeline-parallel size, every configuration (with --tensor-parallel-size T, "
                        "T x this many GPUs)")
    parser.add_argument("--engine-kwargs", default="{}", help="JSON of extra LLM(...) arguments")
    parser.add_argument("--duration", type=float, default=20.0,
                        help="seconds of timed generation per run: passes of the workload (same requests and "
                        "seeds) repeat until this much has accumulated; 0: exactly one pass (default: 20)")
    parser.add_argument("--warmup-passes", type=int, default=1,
                        help="untimed passes of the whole workload before timing (default: 1)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per configuration, each in a fresh process, the order reversed every other "
                        "repeat (default: 3)")
    parser.add_argument("--report", action="store_true",
                        help="after the table, print a markdown section (date, device, commit, command, table) "
                        "for a results page")
    parser.add_argument("--output", help="write every run's numbers and the summary as JSON to this file (default: none)")
    parser.add_argument("--profile", metavar="DIR",
                        help="after the timed passes, one more pass under vLLM's torch profiler: a trace and a "
                        "kernel table per configuration in DIR/<configuration>; the table's top rows are printed (default: no "
                        "profile)")
    parser.add_argument("--profile-steps", type=profile_window, default=(30, 20), metavar="SKIP:STEPS",
                        help="engine steps of the profiled pass to skip, then to profile (default 30:20: past "
                        "the default workload's prefill, decode steps)")
    parser.add_argument("--interleave", action="store_true",
                        help="start every configuration's engine once, side by side on the GPU (each with an "
                        "equal share of gpu_memory_utilization), and alternate their timed runs: one start-up per "
                        "configuration whatever --repeats, and compared runs seconds apart (bench_interleave.py)")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # set for the per-configuration child
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # child of --interleave


FORWARDED = ("model", "workload", "num_prompts", "input_len", "output_len", "samples", "temperature", "seed", "dtype", "max_model_len",
             "load_format", "vocab_limit", "enforce_eager", "tensor_parallel_size",
             "pipeline_parallel_size", "engine_kwargs", "duration", "warmup_passes", "profile",
             "profile_steps")


def forward_args(args) -> list[str]:
    """The child's command line: the parent's workload options (the model resolved)."""
    out = []
    for name in FORWARDED:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, tuple):  # --profile-steps
            out += [flag, ":".join(str(v) for v in value)]
        elif value is not None:
            out += [flag, str(value)]
    return out
