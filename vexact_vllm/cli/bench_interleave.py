"""`vexact-vllm bench --interleave`: every configuration's engine started once, side by side on the
GPU, and their timed runs alternated.

Why: an engine's start-up (60-120 s for stock vLLM on an H100) dominates a bench of fresh processes,
and the host drifts between runs minutes apart; side by side, `--repeats N` costs one start-up per
configuration and the runs being compared are seconds apart.
How: one child process per configuration (its own environment, as in the default mode), started one
after another so that each profiles its memory alone, each with an equal share of the GPU memory
(`gpu_memory_utilization` of --engine-kwargs, vLLM's 0.9 by default, divided by the number of
configurations). A child starts its engine, makes the warm-up passes (of every workload), says ready,
then makes one timed run per "run WORKLOAD" line on its stdin and answers with the run's record; idle
engines wait on their request queue. The order of runs is `run_order`'s, as in the default mode,
workload after workload. The KV cache is smaller than one engine alone would get, the same for every
configuration; several workloads share one engine whose max_model_len is the largest of theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .bench_engine import EngineRun, run_order

READY = "VEXACT_BENCH_READY "
RECORD = "VEXACT_BENCH "
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def shared_engine_kwargs(engine_kwargs: str, configurations: int) -> str:
    """--engine-kwargs with each engine's share of the GPU memory."""
    kwargs = json.loads(engine_kwargs)
    total = float(kwargs.get("gpu_memory_utilization", VLLM_DEFAULT_GPU_MEMORY_UTILIZATION))
    return json.dumps({**kwargs, "gpu_memory_utilization": round(total / configurations, 4)})


def serve(args) -> int:
    """Child: start the engine, warm up, then one timed run per "run WORKLOAD" line until "quit" or EOF."""
    engine = EngineRun(args)
    warmup = engine.warm_up()
    print(READY + json.dumps({"startup_s": engine.startup_s, "warmup_s": warmup}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words == ["quit"]:
            break
        if len(words) != 2 or words[0] != "run" or words[1] not in engine.workloads:
            raise SystemExit(f"error: bench child: unknown command {line.strip()!r} (run WORKLOAD, quit)")
        print(RECORD + json.dumps({**engine.timed(words[1]), "warmup_s": warmup}), flush=True)
    return 0


def _read_tagged(proc: subprocess.Popen, tag: str) -> dict | None:
    """The JSON after `tag` on the child's next tagged line (other lines go to our stderr), or None
    when the child's stdout ends first."""
    for line in proc.stdout:
        if line.startswith(tag):
            return json.loads(line[len(tag) :])
        sys.stderr.write(line)
    return None


def run_interleaved(names: list[str], args, command: list[str], env_of, workloads: list[str]) -> list[dict]:
    """Records in `run_order`, workload after workload (each record names its workload and its
    position in its workload's order); a configuration whose child fails gets failure records, the
    others still run. `command`: the child's command line without --config; `env_of(name)`: its env."""
    children: dict[str, subprocess.Popen] = {}
    ready: dict[str, dict | None] = {}
    results: list[dict] = []
    try:
        for name in names:  # one at a time: vLLM sizes its KV cache from the memory it sees free
            proc = subprocess.Popen([*command, "--config", name, "--serve"], env={**os.environ, **env_of(name)},
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
            children[name], ready[name] = proc, _read_tagged(proc, READY)
            if ready[name] is None:
                print(f"error: configuration {name} did not start (exit {proc.wait()}); see its log above",
                      file=sys.stderr, flush=True)  # fmt: skip
        for workload in workloads:
            for position, (repeat, name) in enumerate(run_order(names, args.repeats)):
                record = None
                if ready[name] is not None:
                    children[name].stdin.write(f"run {workload}\n")
                    children[name].stdin.flush()
                    record = _read_tagged(children[name], RECORD)
                if record is None:
                    ready[name] = None  # a child that stopped answering gets no more runs
                    results.append({"config": name, "workload": workload, "repeat": repeat, "position": position,
                                    "failed": "its engine stopped, see its log on stderr"})  # fmt: skip
                    continue
                results.append({**record, "workload": workload, "repeat": repeat, "position": position})
                print(f"{name} (repeat {repeat}, {workload}): {record['output_tok_s']:.0f} output tok/s over "
                      f"{record['elapsed_s']:.1f} s ({record['passes']} passes), engines side by side",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for proc in children.values():
            if proc.poll() is None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in children.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    return results
