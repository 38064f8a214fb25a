"""Generate with vLLM under the compositions `vexact-vllm check` compares.

A composition is one way of feeding the same requests to vLLM: each prompt alone, all at once,
shuffled, a small token budget that forces chunked prefill, a KV cache sized from the prompts and
output lengths so that two requests cannot finish side by side, forcing preemption and recompute
(`preemption_plan`), CUDA graphs off (`eager`). Every request carries its own seed, so a
bitwise-invariant engine returns the same tokens and log-probs in all of them.

`prefix-cache` feeds other requests, built so that most of their prompt is read from cached KV
blocks: a shared prefix before every prompt, then the same prompts again with other seeds, and each
first rollout continued (prompt + its output, as in a multi-turn rollout: blocks written by decode).
It reports the prefix-cache hits (tokens) vLLM counted, and is a failure when there were none.

With `RolloutSettings.prompt_logprobs` (`check --prompt-logprobs K`) every request also asks for its
prompt's log-probs, except, in `prefix-cache`, the continued rollouts: vLLM never reads cached blocks
for a request that asks for prompt log-probs (`skip_reading_prefix_cache`), so those requests are the
ones that hit, beside prompt-scored requests that recompute what is cached.
"""

from __future__ import annotations

import dataclasses
import gc
import random
from dataclasses import dataclass, field

from vexact_vllm import MODEL_IMPL

from .hybrid_blocks import HybridBlocks, hybrid_blocks
from .records import Rollout, entries_of


@dataclass
class CompositionResult:
    name: str
    rollouts: list[Rollout]
    notes: dict = field(default_factory=dict)  # e.g. {"preemptions": 3}
    problem: str | None = None  # set when the composition did not test what it is for: a failure


@dataclass
class RolloutSettings:
    model: str
    model_impl: str = MODEL_IMPL
    dtype: str = "bfloat16"
    max_model_len: int = 1024
    max_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0
    kv_cache_bytes: int = 64 << 20
    chunk_tokens: int = 32  # max_num_batched_tokens of the chunked-prefill engine
    preempt_blocks: int = 0  # KV blocks of the preemption engine (0: sized from the requests)
    block_size: int = 32  # vLLM CPU attention needs a multiple of 32 (stock runs)
    shared_prefix: list[int] = field(default_factory=list)  # token ids before every prefix-cache prompt
    # Per-request sampling options, request i taking per_request[i % len]: any of temperature,
    # top_k, top_p, min_p, max_tokens (overriding the fields above). Empty: every request the same.
    per_request: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    prompt_logprobs: int | None = None  # top-k of each request's prompt log-probs (None: not asked)

    def request_options(self, index: int) -> dict:
        """temperature, max_tokens (and top_k/top_p/min_p when set) of request `index`."""
        options = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.per_request:
            options.update(self.per_request[index % len(self.per_request)])
        return options


def sampling_params(settings: RolloutSettings, index: int, score_prompt: bool = True):
    """Request `index` samples with seed `settings.seed + index` and its options, and asks for its
    prompt's log-probs when the settings do and `score_prompt`. No detokenization: the check needs ids
    and log-probs only, and a model's vocabulary may run past its tokenizer's."""
    from vllm import SamplingParams

    return SamplingParams(
        **settings.request_options(index),
        seed=settings.seed + index,
        logprobs=0,
        prompt_logprobs=settings.prompt_logprobs if score_prompt else None,
        ignore_eos=True,
        detokenize=False,
    )


class EngineRefused(Exception):
    """vLLM refused the engine while building its configuration (an unsupported architecture,
    sliding window, dtype, option...): the message says what to do; no traceback is needed."""


def refusal_message(err: BaseException) -> str | None:
    """The message of a refusal raised while vLLM builds its configuration, else None. vLLM's config
    classes are pydantic dataclasses, so the ValueError a check raises reaches the caller as a
    pydantic ValidationError ("Value error, <message>"); a plugin check may raise
    UnsupportedModelError directly."""
    from vexact_vllm.model_patches import UnsupportedModelError

    if isinstance(err, UnsupportedModelError):
        return str(err)
    if type(err).__name__ == "ValidationError" and hasattr(err, "errors"):
        try:
            messages = [str(e["msg"]).removeprefix("Value error, ") for e in err.errors()]
        except Exception:  # another ValidationError API: not recognised as a refusal
            return None
        return "; ".join(messages) or None
    return None


def start_engine(settings: RolloutSettings, **overrides):
    from vllm import LLM

    kwargs = dict(
        model=settings.model,
        model_impl=settings.model_impl,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        seed=settings.seed,
        kv_cache_memory_bytes=settings.kv_cache_bytes,
        block_size=settings.block_size,
        disable_log_stats=False,
        enable_prefix_caching=True,
    )
    kwargs.update(settings.extra)
    kwargs.update(overrides)
    try:
        return LLM(**kwargs)
    except Exception as err:
        message = refusal_message(err)
        if message is None:
            raise
        raise EngineRefused(message) from None


def shutdown_engine(llm) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def generate(
    llm, requests: list[tuple[list[int], int]], settings: RolloutSettings, score_prompts: list[bool] | None = None
) -> list[Rollout]:
    """Submit `requests`, (prompt ids, seed index) each, in one call; results in the same order.
    `score_prompts`: per request, whether it asks for prompt log-probs (when the settings do; default all)."""
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    score_prompts = score_prompts or [True] * len(requests)
    params = [sampling_params(settings, index, score) for (_, index), score in zip(requests, score_prompts)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for (ids, index), out, p in zip(requests, outputs, params):
        completion = out.outputs[0]
        logprobs = [step[tok].logprob for tok, step in zip(completion.token_ids, completion.logprobs)]
        temperature = settings.request_options(index)["temperature"]
        prompt_logprobs = None if p.prompt_logprobs is None else entries_of(out.prompt_logprobs)
        result.append(Rollout(list(ids), list(completion.token_ids), logprobs, temperature, prompt_logprobs))
    return result


def _generate_all(llm, prompt_ids, settings, order) -> list[Rollout]:
    """Request i = (prompt i, seed index i), submitted in `order`; results in index order."""
    outs = generate(llm, [(prompt_ids[i], i) for i in order], settings)
    by_index = dict(zip(order, outs))
    return [by_index[i] for i in range(len(prompt_ids))]


def metric_counter(llm, name: str) -> int | None:
    """The sum of vLLM's metric `name` over its label sets; None if vLLM does not expose it."""
    try:
        metrics = [m for m in llm.get_metrics() if getattr(m, "name", None) == name]
    except Exception:  # metrics off, or an API this vLLM lacks: report "n/a", never crash the check
        return None
    values = [getattr(m, "value", None) for m in metrics]
    if not values or any(not isinstance(v, int | float) for v in values):
        return None
    return int(sum(values))


PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # vLLM V1's counter of prompt tokens read from cache


def _prefix_cache(llm, prompt_ids: list[list[int]], settings: RolloutSettings) -> CompositionResult:
    """Requests whose prompts are mostly cached KV blocks (see the module docstring); 3n rollouts."""
    if not settings.shared_prefix:
        raise ValueError("the prefix-cache composition needs RolloutSettings.shared_prefix")
    n, prefix = len(prompt_ids), list(settings.shared_prefix)
    before = metric_counter(llm, PREFIX_CACHE_HITS)
    # 1. shared prefix + prompt i (seed index i): requests the scheduler takes after the first read
    #    the prefix's full blocks from the cache (vLLM caches a block as soon as it is allocated).
    first = generate(llm, [(prefix + p, i) for i, p in enumerate(prompt_ids)], settings)
    # 2. the same prompts again (seeds n + i: other samples) and each first rollout continued
    #    (seeds 2n + i): whole prompts, and blocks filled by decode, hit.
    again = [(prefix + p, n + i) for i, p in enumerate(prompt_ids)]
    continued = [(r.prompt_ids + r.output_ids, 2 * n + i) for i, r in enumerate(first)]
    second = generate(llm, again + continued, settings, [True] * n + [False] * n)  # continued: cache hits
    after = metric_counter(llm, PREFIX_CACHE_HITS)
    hits = None if before is None or after is None else after - before
    name = f"prefix-cache ({len(prefix)}-token prefix)"
    notes = {"prefix-cache hits": "n/a" if hits is None else f"{hits} tok"}
    problem = "no prefix-cache hits: the composition tested nothing" if hits == 0 else None
    return CompositionResult(name, first + second, notes, problem)


SHARED_ENGINE = ("alone", "batch", "shuffled", "prefix-cache")  # run on one engine, in this order
# Seed offset between rounds on the shared engine: each round samples other tokens.
ROUND_SEED_STRIDE = 100_003


class Steps:
    """The progress of `run_compositions`: `start(label)` names the step under way (a progress bar's
    description, when there is one), `done()` counts a finished composition."""

    def __init__(self, progress=None):
        self.progress = progress

    def start(self, label: str) -> None:
        if self.progress is not None and hasattr(self.progress, "set_description_str"):
            self.progress.set_description_str(label)

    def done(self) -> None:
        if self.progress is not None:
            self.progress.update(1)


def _shared_engine_round(llm, prompt_ids, settings, names, suffix, steps: Steps) -> list[CompositionResult]:
    results: list[CompositionResult] = []
    n = len(prompt_ids)
    if "alone" in names:
        steps.start(f"vLLM: alone{suffix} ({n} requests one by one)")
        rollouts = [generate(llm, [(prompt_ids[i], i)], settings)[0] for i in range(n)]
        results.append(CompositionResult("alone" + suffix, rollouts))
        steps.done()
    if "batch" in names:
        steps.start(f"vLLM: batch{suffix}")
        results.append(CompositionResult("batch" + suffix, _generate_all(llm, prompt_ids, settings, list(range(n)))))
        steps.done()
    if "shuffled" in names:
        steps.start(f"vLLM: shuffled{suffix}")
        order = list(range(n))
        random.Random(settings.seed).shuffle(order)
        results.append(CompositionResult("shuffled" + suffix, _generate_all(llm, prompt_ids, settings, order)))
        steps.done()
    if "prefix-cache" in names:  # last in a round: the earlier ones share no prefix with it
        steps.start(f"vLLM: prefix-cache{suffix}")
        result = _prefix_cache(llm, prompt_ids, settings)
        result.name += suffix
        results.append(result)
        steps.done()
    return results


def run_compositions(
    prompt_ids: list[list[int]], settings: RolloutSettings, names: list[str], progress=None, rounds: int = 1
) -> list[CompositionResult]:
    """Run the named compositions; engines are started once each and shut down after use
    (alone, batch, shuffled and prefix-cache share one, on which they run `rounds` times in a row,
    round r with seeds shifted by r * ROUND_SEED_STRIDE and its results named "<name> #r").
    `progress`: a tqdm-like bar, advanced by one per composition run and described by its step."""
    results: list[CompositionResult] = []
    n = len(prompt_ids)
    steps = Steps(progress)

    if set(SHARED_ENGINE) & set(names):
        steps.start("vLLM: starting an engine")
        llm = start_engine(settings)
        try:
            for r in range(rounds):
                shifted = dataclasses.replace(settings, seed=settings.seed + r * ROUND_SEED_STRIDE)
                results += _shared_engine_round(llm, prompt_ids, shifted, names, f" #{r}" if rounds > 1 else "", steps)
        finally:
            shutdown_engine(llm)

    if "chunked-prefill" in names:
        steps.start(f"vLLM: chunked-prefill (starting an engine with a {settings.chunk_tokens}-token budget)")
        llm = start_engine(
            settings,
            enable_chunked_prefill=True,
            max_num_batched_tokens=settings.chunk_tokens,
            max_num_seqs=max(2, min(n, settings.chunk_tokens)),
        )
        try:
            steps.start("vLLM: chunked-prefill")
            rollouts = _generate_all(llm, prompt_ids, settings, list(range(n)))
            results.append(CompositionResult(f"chunked-prefill ({settings.chunk_tokens} tok)", rollouts))
            steps.done()
        finally:
            shutdown_engine(llm)

    if "preemption" in names:
        results.append(_preemption(prompt_ids, settings, steps))

    if "eager" in names:  # batch's requests with CUDA graphs (and torch.compile) off
        steps.start("vLLM: eager (starting an engine without CUDA graphs)")
        llm = start_engine(settings, enforce_eager=True)
        try:
            steps.start("vLLM: eager")
            results.append(CompositionResult("eager", _generate_all(llm, prompt_ids, settings, list(range(n)))))
            steps.done()
        finally:
            shutdown_engine(llm)
    return results


def _preemption(prompt_ids: list[list[int]], settings: RolloutSettings, steps: Steps) -> CompositionResult:
    """Every request generates past a block boundary (at least block_size + 1 tokens), so it must take
    a new KV block mid-decode; the cache is sized by `preemption_plan` so that two requests cannot
    finish side by side: one preempts the other, which is recomputed. A hybrid model's engine gets the
    block size vLLM would settle on for its state pages, and the plan counts its state blocks
    (hybrid_blocks.py)."""
    hybrid = hybrid_blocks(settings.model, settings.dtype, settings.extra.get("tensor_parallel_size", 1),
                           settings.block_size)  # fmt: skip
    if hybrid is not None:
        settings = dataclasses.replace(settings, block_size=hybrid.block_size)
    least = settings.block_size + 1
    grow = dataclasses.replace(
        settings,
        max_tokens=max(settings.max_tokens, least),
        per_request=[{**o, "max_tokens": max(o.get("max_tokens", least), least)} for o in settings.per_request],
    )
    if settings.preempt_blocks:
        blocks, order = settings.preempt_blocks, list(range(len(prompt_ids)))
    else:
        blocks, order = preemption_plan(prompt_ids, grow, hybrid)
    longest = max(len(p) + grow.request_options(i)["max_tokens"] for i, p in enumerate(prompt_ids))
    # vLLM refuses a max_model_len its cache cannot hold (the null block aside); every request fits.
    room = blocks - 1 if hybrid is None else (blocks - 1 - hybrid.state_groups) // hybrid.attention_groups
    max_model_len = min(room * settings.block_size, max(settings.max_model_len, longest))
    steps.start(f"vLLM: preemption (starting an engine with {blocks} KV blocks)")
    seqs = {} if hybrid is None else {"max_num_seqs": min(blocks, grow.extra.get("max_num_seqs", blocks))}  # see check.py
    llm = start_engine(grow, num_gpu_blocks_override=blocks, max_model_len=max_model_len, **seqs)
    try:
        steps.start(f"vLLM: preemption ({blocks} KV blocks)")
        rollouts = _generate_all(llm, prompt_ids, grow, order)
        count = metric_counter(llm, "vllm:num_preemptions")
    finally:
        shutdown_engine(llm)
    problem = None
    if count == 0:
        problem = (
            f"no preemption happened with {blocks} KV blocks of {settings.block_size} tokens: the composition "
            "tested nothing" + ("; it needs two requests or more" if len(prompt_ids) < 2 else "")
        )
    steps.done()
    notes = {"preemptions": "n/a" if count is None else count}
    return CompositionResult(f"preemption ({blocks} blocks)", rollouts, notes, problem)


def shared_blocks(first: list[int], second: list[int], block_size: int) -> int:
    """KV blocks of `second`'s prompt that vLLM's prefix cache can take from `first`'s: the leading
    full blocks the two prompts have in common, less the block holding `second`'s last prompt
    token (vLLM always computes that token)."""
    common = 0
    while (common + 1) * block_size <= min(len(first), len(second)):
        lo, hi = common * block_size, (common + 1) * block_size
        if first[lo:hi] != second[lo:hi]:
            break
        common += 1
    return min(common, (len(second) - 1) // block_size)


def preemption_plan(
    prompt_ids: list[list[int]], settings: RolloutSettings, hybrid: HybridBlocks | None = None
) -> tuple[int, list[int]]:
    """(KV blocks, submission order) that make the preemption composition preempt, whatever the prompts.

    With b(t) = blocks holding t tokens and full(i) = b(prompt + max_tokens) of request i, request A
    (the largest full(i)) goes first, request B second, and the cache holds
    U = max(full(A), b(len A + 1) + b(len B + 1) - shared(A, B)) usable blocks (plus vLLM's null block):
    1. every request can finish alone: U >= full(A) >= full(i);
    2. A and B are admitted side by side: vLLM admits a waiting request only when its whole prompt
       fits, and when B is considered A holds at most b(len A + 1) blocks;
    3. they cannot both run to A's last step: A then holds full(A) > b(len A + 1) blocks (it generates
       past a block boundary) and B at least b(len B + 1) > shared(A, B), more than U together.
    So one of them is preempted and recomputed (3 assumes B is still running at A's end: true when
    every request has the same max_tokens, as in the check). B minimizes the admission bound among
    the requests sharing no prefix-cache block with A (its admission then never hangs on a cache hit);
    only when all share blocks with A (one prompt repeated, a common system prompt) is B one that
    does. The other requests follow in index order. With prefix caching off
    (`enable_prefix_caching=False` in settings.extra) nothing is shared. A hybrid model (`hybrid`: its
    block geometry) counts a request's blocks as `HybridBlocks.request_blocks`: its state blocks are
    held from admission to the end, so the argument is unchanged."""
    n, bs = len(prompt_ids), settings.block_size

    def blocks(tokens: int) -> int:
        return -(-tokens // bs) if hybrid is None else hybrid.request_blocks(tokens)

    full = [blocks(len(p) + settings.request_options(i)["max_tokens"]) for i, p in enumerate(prompt_ids)]
    a = max(range(n), key=lambda i: (full[i], -i))
    if n == 1:
        return full[a] + 1, [a]
    caching = settings.extra.get("enable_prefix_caching", True)

    def shared(i: int) -> int:
        return shared_blocks(prompt_ids[a], prompt_ids[i], bs) if caching else 0

    def admission(i: int) -> int:
        return blocks(len(prompt_ids[a]) + 1) + blocks(len(prompt_ids[i]) + 1) - shared(i)

    others = [i for i in range(n) if i != a]
    b = min(others, key=lambda i: (shared(i) > 0, admission(i), i))
    usable = max(full[a], admission(b))
    return usable + 1, [a, b] + [i for i in others if i != b]
