"""Every request and engine option of vLLM, classified: honoured, neutral or refused (an allow-list).

The vexact sampler replaces vLLM's, and vexact models replace vLLM's layers, so an option vLLM
applies inside its own sampler or model would be dropped silently: tokens and log-probs would still
match the trainer, but the request would lose its meaning. So every `SamplingParams` field and every
`EngineArgs` field of the vLLM versions in `versions.MANIFEST_VERSIONS` is classified here, once,
with the reason it shares with its group:

- request side (`SamplingParams`): honoured (`HONOURED_REQUEST`), vLLM-internal derived state
  (`INTERNAL_REQUEST`), or refused when set (`REFUSED_REQUEST`, some on one model runner only);
- engine side (`EngineArgs`, `AsyncEngineArgs`): honoured (`HONOURED_ENGINE`), neutral, i.e. no effect
  on what the model or the sampler computes (`NEUTRAL_ENGINE`), or refused for the values a row
  names (`REFUSED_ENGINE`). Most refusals are decided here, on the arguments; the rows marked
  `CONFIG_HOOK` are decided on the resolved configuration by engine_checks.py (they need the
  resolved dtype, backend or quantization), with the messages they have there.

A field of neither list (a vLLM version newer than the ones classified) set to anything but its
default is refused as "not verified with --model-impl vexact": an upgrade cannot add a silent drop.

Where the checks run:
- `refuse_request_options(params, use_v2_model_runner)`: at admission (request_validation.py, HTTP
  400) and again per row in the V1 sampler;
- `refuse_engine_args(engine_args)`: in the front-end, as vLLM builds its configuration
  (`EngineArgs.create_engine_config`, a row of vllm_patches.py, only for `--model-impl vexact`);
- `refuse_engine_config(vllm_config)`: the same refusals read back from the resolved configuration,
  the worker's second line (engine_checks.refuse_unsupported_engine);
- `refuse_batch_invariant()`: `VLLM_BATCH_INVARIANT=1`, read through vLLM's envs module, by both.

Log-probs: `logprobs_mode` "raw_logprobs" and "processed_logprobs" (verl's default) both return the
vexact log-prob, the trainer's value (the full-vocabulary log-softmax of the tempered logits; top-k,
top-p and min-p narrow only which tokens may be drawn). The logits modes are refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vexact_vllm.model_patches.config import UnsupportedModelError

from .versions import MANIFEST_VERSIONS

CONFIG_HOOK = "config hook"  # REFUSED_ENGINE rows decided on the resolved configuration (engine_checks.py)


@dataclass(frozen=True)
class Group:
    """Fields that share one reason."""

    fields: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Refusal:
    """Fields refused for the values `refused(value)` names (None: any value but vLLM's default)."""

    fields: tuple[str, ...]
    why: str
    fix: str
    refused: Callable[[Any], bool] | None = None
    runner: str | None = None  # request side: refused on this model runner only ("v1" or "v2")
    config: dict[str, str] = field(default_factory=dict)  # engine field -> its path on the VllmConfig
    where: str = "front end"  # or CONFIG_HOOK
    what: str | None = None  # how the message names the option (default: its flag)


def _true(value) -> bool:
    return value is True


def _above_one(value) -> bool:
    """A size above 1, or a flag that is on."""
    return value if isinstance(value, bool) else (value or 1) > 1


def _other_than(*allowed) -> Callable[[Any], bool]:
    return lambda value: value not in allowed


def _part(value, key):
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


def _on(value) -> bool:
    return bool(value)


def _part_set(key) -> Callable[[Any], bool]:
    """A config (or its dict) with `key` set; the flag itself when the field is that flag."""
    return lambda value: value is True or _part(value, key) not in (None, False)


# --- request side: SamplingParams ------------------------------------------------------------------

HONOURED_REQUEST = (
    Group(("temperature", "seed", "top_k", "top_p", "min_p"),
          "the vexact sampler's inputs: the temperature tempers the trainer's log-probs, the seed keys "
          "the Gumbel noise, top-k/top-p/min-p narrow which tokens may be drawn (the returned log-prob "
          "stays the full-vocabulary one)"),
    Group(("n", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output",
           "repetition_detection"),
          "how many samples and when each stops: vLLM's scheduler and output processor apply them, "
          "outside the sampler"),
    Group(("logprobs", "prompt_logprobs", "flat_logprobs"),
          "the sampled token's, the prompt tokens' and the top-k log-probs, gathered from the vexact "
          "log-probs (the trainer's values; ties in the top-k go to the lower id) on both runners; "
          "flat_logprobs changes only their container"),
    Group(("detokenize", "skip_special_tokens", "spaces_between_special_tokens", "output_kind",
           "stream_interval"),
          "how the output is detokenized and streamed"),
    Group(("skip_reading_prefix_cache",), "whether prefix-cache hits are used: the bits are the same"),
    Group(("extra_args",),
          "free-form arguments read only by KV/encoder-cache connectors and custom logits processors, "
          "both refused at start-up"),
)  # fmt: skip

INTERNAL_REQUEST = Group(
    ("output_text_buffer_length", "_eos_token_id", "_all_stop_token_ids", "_bad_words_token_ids",
     "_watermarking_skipped", "skip_clone"),
    "derived or internal state that vLLM sets itself",
)  # fmt: skip

DISTRIBUTION = Refusal(
    ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
     "allowed_token_ids", "min_tokens", "structured_outputs"),
    "they change the sampling distribution that the trainer's log-probs describe",
    "drop them from the request (temperature, seed, top_k, top_p and min_p are supported)",
)  # fmt: skip

REFUSED_REQUEST = (
    DISTRIBUTION,
    Refusal(("thinking_token_budget",),
            "vLLM ends the thinking section inside its own sampler, which the vexact sampler replaces, "
            "so the budget would be ignored",
            "drop it from the request (bound the response with max_tokens)"),
    Refusal(("trace_decode_token_ids",),
            "it forces the decoded tokens inside vLLM's sampler, which the vexact sampler replaces",
            "drop it from the request (score a fixed response with the trainer)"),
    Refusal(("watermarking",),
            "a watermark changes which token is drawn, away from the distribution the trainer's "
            "log-probs describe", "drop it from the request", refused=_true),
    Refusal(("prompt_logprob_token_ids", "prompt_logprob_start"),
            "vLLM scores them with its own log-softmax, not the trainer's",
            "drop them from the request (score prompts with the trainer)"),
    Refusal(("routed_experts_prompt_start",),
            "vexact MoE layers return no routed experts (--enable-return-routed-experts is refused)",
            "drop it from the request"),
    Refusal(("logprob_token_ids",),
            "the V1 runner's vexact sampler returns the sampled token's and the top-k log-probs only",
            "ask for logprobs=N instead, or use model runner v2 (the GPU default)", runner="v1"),
)  # fmt: skip

_LABELS = {"structured_outputs": "structured_outputs (guided decoding, response_format)"}


# --- engine side: EngineArgs -----------------------------------------------------------------------

HONOURED_ENGINE = (
    Group(("model", "model_weights", "tokenizer", "hf_config_path", "revision", "code_revision",
           "tokenizer_revision", "hf_token", "trust_remote_code", "config_format", "tokenizer_mode",
           "skip_tokenizer_init", "dtype", "max_model_len", "seed", "model_impl", "max_logprobs",
           "generation_config", "override_generation_config"),
          "the checkpoint, its tokenizer and its generation defaults (a request's temperature, top_k, "
          "top_p, min_p defaults); the dtype is checked on the resolved configuration (bfloat16, float32)"),
    Group(("load_format", "download_dir", "safetensors_load_strategy", "safetensors_prefetch_num_threads",
           "safetensors_prefetch_block_size", "model_loader_extra_config", "ignore_patterns",
           "use_tqdm_on_load", "pt_load_map_location", "max_parallel_loading_workers"),
          "how the weights are read; the loaded tensors are the checkpoint's"),
    Group(("max_num_seqs", "max_num_batched_tokens", "max_num_scheduled_tokens", "max_num_partial_prefills",
           "max_long_partial_prefills", "long_prefill_token_threshold", "long_prefill_token_threshold_adaptive",
           "max_num_active_seqs", "max_num_queued_reqs", "max_num_queued_tokens", "enable_chunked_prefill",
           "scheduler_reserve_full_isl", "prefill_schedule_interval", "scheduling_policy", "scheduler_cls",
           "async_scheduling", "watermark", "block_size", "enable_prefix_caching", "prefix_caching_hash_algo",
           "prefix_cache_retention_interval", "prefix_match_unit", "gpu_memory_utilization",
           "kv_cache_memory_bytes", "num_gpu_blocks_override"),
          "batching, chunked prefill, preemption, prefix-cache hits and the KV cache's size: every step "
          "is batch-invariant, so the bits do not depend on them (`vexact-vllm check` composes them)"),
    Group(("enforce_eager", "compilation_config", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
           "optimization_level", "performance_mode"),
          "CUDA graphs and compilation around the vexact kernels: the same kernels replayed"),
    Group(("tensor_parallel_size", "data_parallel_size", "data_parallel_rank", "data_parallel_start_rank",
           "data_parallel_size_local", "data_parallel_address", "data_parallel_rpc_port",
           "data_parallel_hybrid_lb", "data_parallel_external_lb", "data_parallel_multi_port_external_lb",
           "data_parallel_backend", "dp_sync_interval", "disable_nccl_for_dp_synchronization",
           "distributed_executor_backend", "master_addr", "master_port", "nnodes", "node_rank",
           "distributed_timeout_seconds", "cpu_distributed_timeout_seconds", "device_ids", "numa_bind",
           "numa_bind_nodes", "numa_bind_cpus", "disable_custom_all_reduce", "ray_workers_use_nsight",
           "enable_shm_tensor_arena", "_api_process_count", "_api_process_rank", "pipeline_parallel_size"),
          "tensor parallelism (its split of the heads is checked; vexact layers exchange column blocks, "
          "never partial sums), pipeline parallelism (whole layers per stage, the hidden states and the residual "
          "handed over; a partition that leaves a stage without a layer is refused on the resolved "
          "configuration), data-parallel replicas, and where their processes run"),
    Group(("enable_sleep_mode", "sleep_mode_backend", "sleep_mode_offload_cudagraph",
           "sleep_preserve_parameter_names", "enable_cumem_allocator", "enable_nccl_comm_suspend",
           "worker_extension_cls"),
          "sleep mode and weight updates (verl's colocated rollout): memory freed and restored, "
          "weights replaced; the computation is unchanged"),
)  # fmt: skip

NEUTRAL_ENGINE = (
    Group(("served_model_name", "disable_log_stats", "aggregate_engine_logging", "enable_log_requests",
           "show_hidden_metrics_for_version", "otlp_traces_endpoint", "collect_detailed_traces",
           "per_request_spec_decode_metrics", "kv_cache_metrics", "kv_cache_metrics_sample",
           "custom_histogram_buckets", "cudagraph_metrics", "enable_layerwise_nvtx_tracing",
           "enable_mfu_metrics", "enable_logging_iteration_details", "jit_monitor_mode",
           "jit_monitor_verbose", "enable_mm_processor_stats", "profiler_config", "logging_config",
           "log_level", "log_config_file", "kv_events_config", "stream_interval", "renderer_num_workers",
           "shutdown_timeout", "fail_on_environ_validation", "tokens_only", "fault_tolerance_config",
           "enable_fault_tolerance", "watchdog_config", "additional_config"),
          "the server, logging, metrics, tracing, profiling and fault handling (additional_config is read "
          "by out-of-tree platform plugins only)"),
    Group(("reasoning_parser", "reasoning_parser_plugin", "reasoning_config", "structured_outputs_config"),
          "parsers and backends of the output text; the request options that would steer the sampler "
          "through them (structured outputs, thinking_token_budget) are refused at admission"),
    Group(("kernel_config", "moe_backend", "linear_backend", "ir_op_priority", "sparse_indexer_topk_backend",
           "gdn_prefill_backend", "kda_prefill_backend", "kda_decode_backend", "mamba_backend",
           "mamba_ssu_algorithm", "monokernel", "enable_flashinfer_autotune", "enable_bf16x3_router_gemm",
           "disable_cascade_attn", "all2all_backend"),
          "kernel choices for vLLM's own layers; vexact models run their own kernels"),
    Group(("allowed_local_media_path", "allowed_media_domains", "language_model_only", "limit_mm_per_prompt",
           "enable_mm_embeds", "interleave_mm_strings", "media_io_kwargs", "mm_processor_kwargs",
           "mm_processor_cache_gb", "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb",
           "mm_encoder_only", "mm_encoder_tp_mode", "mm_encoder_attn_backend", "mm_encoder_attn_dtype",
           "mm_encoder_fp8_scale_path", "mm_encoder_fp8_scale_save_path", "mm_encoder_fp8_scale_save_margin",
           "skip_mm_profiling", "video_pruning_rate", "video_pruning_method", "mm_tensor_ipc",
           "mm_ipc_gpu_memory_gb", "mm_processor_device", "mm_device_do_normalize", "mm_hasher_algorithm",
           "ec_transfer_config", "ec_manager_config", "default_mm_loras"),
          "multimodal inputs and their encoders: vexact architectures are text-only"),
    Group(("mamba_config", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size", "mamba_cache_mode",
           "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len", "use_replayssm",
           "enable_mamba_cache_stochastic_rounding", "mamba_cache_philox_rounds", "engram_config",
           "swa_bounded_replay", "disable_sliding_window", "kv_sharing_fast_prefill", "diffusion_config",
           "enable_hc_sp", "disable_hybrid_kv_cache_manager", "disable_chunked_mm_input", "pooler_config",
           "io_processor_plugin"),
          "settings of architectures and runners --model-impl vexact refuses (state-space, hybrid, "
          "sliding-window, KV-sharing, diffusion, n-gram-embedding, HyperConnection, multimodal, pooling)"),
    Group(("max_loras", "max_lora_rank", "fully_sharded_loras", "max_cpu_loras", "lora_dtype",
           "lora_target_modules", "enable_tower_connector_lora", "specialize_active_lora",
           "enable_mixed_moe_lora_format", "enable_moe_shared_loras", "max_lora_cls_labels",
           "enable_ep_weight_filter", "eplb_config", "expert_placement_strategy", "elastic_ep_max_dp_size",
           "dbo_decode_token_threshold", "dbo_prefill_token_threshold", "dcp_comm_backend", "dcp_q_replicate",
           "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size", "kv_cache_dtype_skip_layers",
           "allow_deprecated_quantization", "offload_backend", "cpu_offload_params", "offload_num_in_group",
           "offload_prefetch_step", "offload_params", "kv_offloading_backend"),
          "take effect only with an option refused below (LoRA, expert parallelism, dual-batch overlap, "
          "context parallelism, a quantized KV cache, quantization, weight or KV-cache offloading)"),
)  # fmt: skip

_NOT_VERIFIED = "it is not verified with vexact models"

REFUSED_ENGINE = (
    Refusal(("enable_prompt_embeds",),
            "vexact models embed the token ids themselves, as the trainer does (vLLM's worker would fail "
            "on its first step)", "drop it and send token ids",
            config={"enable_prompt_embeds": "model_config.enable_prompt_embeds"}),
    Refusal(("return_sampling_mask", "enable_trace_replay", "use_fp64_gumbel", "enable_batch_sharded_sampling"),
            "it acts inside vLLM's sampler (forced tokens, a sampling mask, fp64 Gumbel noise, sampling "
            "sharded across ranks), which the vexact sampler replaces: it draws its own noise, keyed by "
            "seed and position, for every row on every rank", "drop it",
            refused=_on,
            config={"return_sampling_mask": "model_config.return_sampling_mask",
                    "enable_trace_replay": "model_config.enable_trace_replay",
                    "use_fp64_gumbel": "model_config.use_fp64_gumbel",
                    "enable_batch_sharded_sampling": "parallel_config.enable_batch_sharded_sampling"}),
    Refusal(("watermark_config",),
            "a watermark changes which token is drawn, away from the distribution the trainer's "
            "log-probs describe", "drop it", config={"watermark_config": "watermark_config"}),
    Refusal(("logprobs_mode",),
            "vexact returns log-probs, the trainer's values (raw_logprobs and processed_logprobs both "
            "return them), never logits", "use raw_logprobs or processed_logprobs",
            refused=_other_than("raw_logprobs", "processed_logprobs"),
            config={"logprobs_mode": "model_config.logprobs_mode"}),
    Refusal(("enable_return_routed_experts", "aux_output_config"),
            "vexact MoE layers return no routed experts; they route as the trainer does, bit for bit, "
            "so rollout routing replay (verl's R3) has nothing to correct",
            "drop it (verl: actor_rollout_ref.rollout.enable_rollout_routing_replay=False)",
            refused=_part_set("enable_return_routed_experts"),
            what="returning routed experts (--enable-return-routed-experts)",
            config={"enable_return_routed_experts": "model_config.enable_return_routed_experts",
                    "aux_output_config": "aux_output_config"}),
    Refusal(("enable_dbo", "ubatch_size"),
            "dual-batch overlap and micro-batching split each step inside vLLM's runner; "
            + _NOT_VERIFIED, "drop it", refused=_above_one,
            config={"enable_dbo": "parallel_config.enable_dbo", "ubatch_size": "parallel_config.ubatch_size"}),
    Refusal(("prefill_context_parallel_size", "decode_context_parallel_size"),
            "context parallelism splits the keys across ranks inside vLLM's attention, which the vexact "
            "attention backend replaces", "use tensor parallelism (--tensor-parallel-size) instead",
            refused=_above_one,
            config={"prefill_context_parallel_size": "parallel_config.prefill_context_parallel_size",
                    "decode_context_parallel_size": "parallel_config.decode_context_parallel_size"}),
    Refusal(("attention_config",),
            "HiSparse replaces the KV cache and the attention with vLLM's own sparse ones",
            "drop hisparse_config from --attention-config", refused=_part_set("hisparse_config"),
            what="HiSparse (--attention-config hisparse_config)",
            config={"attention_config": "attention_config"}),
    Refusal(("enable_eplb", "enable_elastic_ep"),
            "expert load balancing moves experts between ranks (expert parallelism is refused)", "drop it",
            config={"enable_eplb": "parallel_config.enable_eplb",
                    "enable_elastic_ep": "parallel_config.enable_elastic_ep"}),
    Refusal(("model_class_overrides",), "it replaces the model class; --model-impl vexact builds its own",
            "drop it", config={"model_class_overrides": "model_config.model_class_overrides"}),
    Refusal(("hf_overrides",), "the trainer loads config.json and would not see the overrides",
            "write them into the checkpoint's config.json instead"),
    Refusal(("runner", "convert"),
            "vexact models generate; pooling and draft runners and converted models are not vexact models",
            "drop --runner and --convert (or use --runner generate)",
            refused=_other_than("auto", "generate", "none")),
    Refusal(("override_attention_dtype", "calculate_kv_scales"),
            "the attention and its keys and values stay in the model's dtype, as in the trainer", "drop it",
            config={"override_attention_dtype": "model_config.override_attention_dtype",
                    "calculate_kv_scales": "cache_config.calculate_kv_scales"}),
    Refusal(("kv_transfer_config", "kv_offloading_size", "cpu_offload_gb", "offload_group_size",
             "weight_transfer_config"),
            "moving KV caches or weights between engines, hosts or devices: " + _NOT_VERIFIED, "drop it",
            config={"kv_transfer_config": "kv_transfer_config",
                    "weight_transfer_config": "weight_transfer_config"}),
    Refusal(("worker_cls",), "a worker class of yours replaces vLLM's: " + _NOT_VERIFIED, "drop it"),
    Refusal(("quantization", "quantization_config"), "the trainer computes in bf16/fp32",
            "serve the unquantized checkpoint without --quantization and --quantization-config"),
    Refusal(("kv_cache_dtype", "attention_backend", "enable_expert_parallel",
             "speculative_config", "spec_method", "spec_model", "spec_tokens", "enable_lora", "logits_processors"),
            "decided on the resolved configuration (the KV cache dtype must be the model's, the attention "
            "backend vexact's; expert parallelism, a checkpoint's own quantization, speculative "
            "decoding, LoRA and custom logits processors are refused)", "see the message", where=CONFIG_HOOK),
)  # fmt: skip

# A hybrid model's (Gated DeltaNet layers: Qwen3-Next, Qwen3.5) engine: each of these LLM(...) arguments only
# at its value, the message refusing any other (engine_checks.refuse_unsupported_state_cache, on the resolved
# configuration). The fuzzer draws hybrid engines with these values.
HYBRID_ENGINE: dict[str, tuple[Any, str]] = {
    "enable_prefix_caching": (False,
        "prefix caching is not supported for Qwen3-Next / Qwen3.5 (Gated DeltaNet) with --model-impl vexact: "
        "vLLM restores their recurrent states from prefix-cache blocks in a way vexact-vllm has not made "
        "bitwise equal to the trainer yet, and it does not serve approximately. Serve with "
        "--no-enable-prefix-caching (LLM(..., enable_prefix_caching=False); in verl "
        "actor_rollout_ref.rollout.enable_prefix_caching=False)"),
}  # fmt: skip


def prefix_caching(model: str) -> bool:
    """Whether vexact serves `model` (a checkpoint directory or a hub id) with prefix caching: HYBRID_ENGINE's
    value for the Gated DeltaNet families, vLLM's default (on) for the others. Recipes set verl's
    actor_rollout_ref.rollout.enable_prefix_caching from it (examples/verl/run_qwen3_grpo_gsm8k.sh). True
    where the config cannot be read here (a hub id offline): the engine reads it again and refuses prefix
    caching for those families with its message."""
    from transformers import PretrainedConfig

    from vexact_vllm.model_patches.families import BY_MODEL_TYPE

    try:
        model_type = PretrainedConfig.get_config_dict(model)[0].get("model_type", "")
    except OSError:
        return True
    family = BY_MODEL_TYPE.get(model_type)
    return HYBRID_ENGINE["enable_prefix_caching"][0] if family is not None and family.hybrid else True


def groups(side: str) -> dict[str, tuple]:
    """The lists of one side ("request" or "engine"), by name."""
    if side == "request":
        return {"honoured": HONOURED_REQUEST, "internal": (INTERNAL_REQUEST,), "refused": REFUSED_REQUEST}
    return {"honoured": HONOURED_ENGINE, "neutral": NEUTRAL_ENGINE, "refused": REFUSED_ENGINE}


@functools.cache
def classified(side: str) -> frozenset[str]:
    return frozenset(name for rows in groups(side).values() for row in rows for name in row.fields)


# --- fields and defaults of the classes checked ---------------------------------------------------

_NO_DEFAULT = object()


@functools.cache
def field_defaults(cls) -> dict[str, Any]:
    """Field name -> default of a msgspec Struct (SamplingParams) or a dataclass (EngineArgs)."""
    if dataclasses.is_dataclass(cls):
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = _NO_DEFAULT
        return out
    import msgspec

    return {
        f.name: (f.default if f.default is not msgspec.NODEFAULT
                 else f.default_factory() if f.default_factory is not msgspec.NODEFAULT else _NO_DEFAULT)
        for f in msgspec.structs.fields(cls)
    }  # fmt: skip


@functools.cache
def unclassified(cls, side: str) -> tuple[str, ...]:
    """The fields of `cls` that neither list of `side` names (a vLLM newer than the ones classified)."""
    return tuple(sorted(set(field_defaults(cls)) - classified(side)))


def is_default(value, default) -> bool:
    """Whether `value` leaves an option off: vLLM's default, None, or an empty container."""
    if value is None or value is default:
        return True
    if isinstance(value, (list, tuple, dict, set, frozenset, str)) and not value:
        return True
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # an array: set
        return False


def _is_set(row: Refusal, value, default) -> bool:
    return row.refused(value) if row.refused is not None else not is_default(value, default)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- request side ---------------------------------------------------------------------------------


def refuse_request_options(params, use_v2_model_runner: bool) -> None:
    """Raise ValueError for a request option the vexact path cannot serve (the first refusing row,
    naming every option of it that is set), or an unclassified option set to a non-default value."""
    defaults = field_defaults(type(params))
    runner = "v2" if use_v2_model_runner else "v1"
    for row in REFUSED_REQUEST:
        if row.runner not in (None, runner):
            continue
        bad = [name for name in row.fields
               if name in defaults and _is_set(row, getattr(params, name, None), defaults[name])]  # fmt: skip
        if bad:
            names = ", ".join(_LABELS.get(name, name) for name in bad)
            many = len(bad) > 1
            on = {"v1": "on vLLM's V1 model runner", "v2": "on vLLM's model runner v2"}.get(row.runner, "")
            raise ValueError(
                f"sampling option{'s' if many else ''} {names} {'are' if many else 'is'} not supported with "
                f"--model-impl vexact{' ' + on if on else ''}: {row.why}; {row.fix}"
            )
    for name in unclassified(type(params), "request"):
        value = getattr(params, name, None)
        if not is_default(value, defaults[name]):
            raise ValueError(
                f"sampling option {name}={_shown(value)} is not verified with --model-impl vexact: vexact-vllm "
                f"has classified the options of vLLM {', '.join(MANIFEST_VERSIONS)}, and the vexact sampler, "
                "which replaces vLLM's, may not apply a newer one; drop it from the request"
            )


# --- engine side ----------------------------------------------------------------------------------

BATCH_INVARIANT_MESSAGE = (
    "VLLM_BATCH_INVARIANT=1 is not supported with --model-impl vexact: vexact models are batch-invariant by "
    "their own kernels; VLLM_BATCH_INVARIANT replaces vLLM's own kernels and vLLM 0.33 refuses the vexact "
    "attention backend under it: unset it"
)


def refuse_batch_invariant() -> None:
    import vllm.envs as envs

    if getattr(envs, "VLLM_BATCH_INVARIANT", False):
        raise UnsupportedModelError(BATCH_INVARIANT_MESSAGE)


def _engine_refusal(row: Refusal, name: str, value) -> UnsupportedModelError:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        flag = f"{flag} {value}"
    return UnsupportedModelError(
        f"{row.what or flag} is not supported with --model-impl vexact: {row.why}; {row.fix}"
    )


def refuse_engine_args(args) -> None:
    """Raise UnsupportedModelError for an engine argument refused by a front-end row of REFUSED_ENGINE,
    an unclassified one set to a non-default value, or VLLM_BATCH_INVARIANT=1."""
    refuse_batch_invariant()
    defaults = field_defaults(type(args))
    for row in REFUSED_ENGINE:
        if row.where != CONFIG_HOOK:
            for name in row.fields:
                if name in defaults and _is_set(row, getattr(args, name), defaults[name]):
                    raise _engine_refusal(row, name, getattr(args, name))
    for name in unclassified(type(args), "engine"):
        value = getattr(args, name)
        if not is_default(value, defaults[name]):
            raise UnsupportedModelError(
                f"engine option --{name.replace('_', '-')} ({name}={_shown(value)}) is not verified with "
                f"--model-impl vexact: vexact-vllm has classified the options of vLLM "
                f"{', '.join(MANIFEST_VERSIONS)}, and a newer one may change what the worker or the sampler "
                "computes; drop it"
            )


def _config_value(config, path: str):
    for part in path.split("."):
        config = getattr(config, part, None)
        if config is None:
            return None
    return config


def refuse_engine_config(vllm_config) -> None:
    """The front-end rows' refusals, read from a resolved VllmConfig (absent attributes: not set)."""
    refuse_batch_invariant()
    from vllm.engine.arg_utils import EngineArgs

    defaults = field_defaults(EngineArgs)
    for row in REFUSED_ENGINE:
        for name, path in row.config.items():
            value = _config_value(vllm_config, path)
            if value is not None and _is_set(row, value, defaults.get(name)):
                raise _engine_refusal(row, name, value)
