"""One configuration's engine for `vexact-vllm bench`: the configurations, the engine that times
passes of a workload, and the order runs take.

Below both ways of running a bench: fresh processes, one per run (bench.py), and engines side by
side whose runs alternate (bench_interleave.py); both import from here, neither from the other.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from vexact_vllm import MODEL_IMPL

from .bench_workloads import for_workload, requests
from .model_engine import engine_for

CONFIGS = {
    "stock": {"model_impl": "vllm", "env": {}},
    "stock-batch-invariant": {"model_impl": "vllm", "env": {"VLLM_BATCH_INVARIANT": "1"}},
    "vexact": {"model_impl": MODEL_IMPL, "env": {}},
    # Asked for by name only (--configs): vexact with one user setting changed.
    # Shared-prompt decode groups (the same bits; they take no key split).
    "vexact-shared-prefix": {"model_impl": MODEL_IMPL, "env": {"VEXACT_SHARED_PREFIX": "1", "VEXACT_KEY_SPLIT": "0"}},
    # Another attention (other bits: the trainer must run it too), on SM90 with flash-attn-4 installed.
    "vexact-fa4": {"model_impl": MODEL_IMPL, "env": {"VEXACT_ATTENTION": "fa4"}},
    # Key splits: none, every 1,024 / 2,048 keys (2,048 is the default; other bits past the first
    # split: the trainer must read the same setting).
    "vexact-nosplit": {"model_impl": MODEL_IMPL, "env": {"VEXACT_KEY_SPLIT": "0"}},
    "vexact-split1024": {"model_impl": MODEL_IMPL, "env": {"VEXACT_KEY_SPLIT": "1024"}},
    "vexact-split2048": {"model_impl": MODEL_IMPL, "env": {"VEXACT_KEY_SPLIT": "2048"}},
}
DEFAULT_CONFIGS = ("stock", "stock-batch-invariant", "vexact")


def timed_passes(generate: Callable[[], int], duration: float, before: Callable[[], object] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> list[tuple[int, float]]:  # fmt: skip
    """(output tokens, seconds) of each pass: `before()` untimed, then `generate()` timed, until the
    timed seconds add up to at least `duration`; one pass when `duration` is 0."""
    passes: list[tuple[int, float]] = []
    while not passes or sum(s for _, s in passes) < duration:
        before()
        t = clock()
        tokens = generate()
        passes.append((tokens, clock() - t))
    return passes


class EngineRun:
    """One configuration's engine in this process (`args.config`): started on construction, then
    warm-up passes and timed runs over the same requests. `args.workload` may name several workloads
    (`--interleave`): one engine serves each one's requests in turn."""

    def __init__(self, args):
        from vllm import LLM

        self.args = args
        t0 = time.perf_counter()
        model, asked = checkpoint_engine(args.model, args.config)
        self.llm = LLM(
            model, model_impl=CONFIGS[args.config]["model_impl"], dtype=args.dtype, seed=args.seed,
            load_format=args.load_format, skip_tokenizer_init=True, max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            **{**asked, **profiler_kwargs(args), **json.loads(args.engine_kwargs)},
        )  # fmt: skip
        self.startup_s = time.perf_counter() - t0
        self.workloads = {name: self._requests(for_workload(args, name)) for name in args.workload.split(",")}

    @staticmethod
    def _requests(args) -> tuple[list, list]:
        from vllm import SamplingParams

        reqs = requests(args)
        prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=args.temperature,
                                 seed=r.seed, detokenize=False) for r in reqs]  # fmt: skip
        return prompts, params

    def reset_prefix_cache(self) -> None:  # else a repeated pass would skip most of its prefill
        for _ in range(20):  # vLLM says False while finished requests still hold blocks
            if self.llm.reset_prefix_cache() is not False:
                return
            time.sleep(0.05)
        raise RuntimeError("vLLM could not reset its prefix cache between passes")

    def generate(self, workload: str | None = None) -> int:
        prompts, params = self.workloads[workload or next(iter(self.workloads))]
        return sum(len(o.outputs[0].token_ids) for o in self.llm.generate(prompts, params, use_tqdm=False))

    def warm_up(self) -> float:
        """The untimed passes, of every workload; their seconds."""
        t1 = time.perf_counter()
        for workload in self.workloads:
            for _ in range(self.args.warmup_passes):
                self.reset_prefix_cache()
                self.generate(workload)
        return time.perf_counter() - t1

    def timed(self, workload: str | None = None) -> dict:
        """Timed passes of `workload` (the only one when None) until --duration seconds: the run's record."""
        import torch

        workload = workload or next(iter(self.workloads))
        passes = timed_passes(lambda: self.generate(workload), self.args.duration, before=self.reset_prefix_cache)
        tokens, elapsed = sum(n for n, _ in passes), sum(s for _, s in passes)
        return {"config": self.args.config, "workload": workload, "startup_s": self.startup_s, "elapsed_s": elapsed,
                "output_tokens": tokens, "output_tok_s": tokens / elapsed, "passes": len(passes),
                "pass_tokens": [n for n, _ in passes], "pass_s": [s for _, s in passes],
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"}  # fmt: skip


def checkpoint_engine(model_path: str, config: str) -> tuple[str, dict]:
    """(the checkpoint configuration `config` loads, the engine arguments it asks for):
    `model_engine.engine_for` (a hybrid's prefix caching off; for stock a text-only Qwen3.5's
    published-layout twin, its language model only, the Triton GDN prefill without FlashInfer);
    --engine-kwargs can override the arguments."""
    return engine_for(model_path, stock=CONFIGS[config]["model_impl"] != MODEL_IMPL)


def checkpoint_line(model_path: str, names: list[str]) -> str:
    """The engine arguments `checkpoint_engine` gives each of the configurations `names`, for the report
    ('' when none)."""
    parts = []
    for name in names:
        _, kwargs = checkpoint_engine(model_path, name)
        if kwargs:
            parts.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in kwargs.items()))
    return "; ".join(parts)


def profiler_dir(args) -> str:
    return os.path.join(os.path.abspath(args.profile), args.config)


def profiler_kwargs(args) -> dict:
    """LLM(...) arguments for --profile: vLLM's torch profiler over engine steps [skip, skip + steps)
    of the profiled pass, without Python stacks; it writes a trace and a kernel table
    (*profiler_out*.txt) into DIR/<configuration>."""
    if not args.profile:
        return {}
    skip, steps = args.profile_steps
    return {"profiler_config": {
        "profiler": "torch", "torch_profiler_dir": profiler_dir(args), "torch_profiler_with_stack": False,
        "delay_iterations": skip, "max_iterations": steps, "ignore_frontend": True,
    }}  # fmt: skip


def run_order(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, configuration) in running order: `names` in repeat 0, reversed in repeat 1, and so on."""
    return [(r, name) for r in range(repeats) for name in (names if r % 2 == 0 else names[::-1])]
