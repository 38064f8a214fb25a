"""Refuse, when vLLM builds its configuration, the engine options that would break the bitwise contract.

Three checks, each called from two places:
- `option_policy.refuse_engine_args(engine_args)`: the engine arguments, against the allow-list of
  option_policy.py (every `EngineArgs` field honoured, neutral or refused; an unclassified one set is
  refused), and `VLLM_BATCH_INVARIANT`. `wrap_create_engine_config` (a row of vllm_patches.py) runs it
  first thing in `EngineArgs.create_engine_config` for `--model-impl vexact`, and logs the version
  note once (versions.py).
- `refuse_unsupported_model(model_config)`: the checkpoint (`DecoderConfig.from_hf`), the resolved
  dtype, `--quantization`, custom logits processors;
- `refuse_unsupported_engine(vllm_config)`: the above plus the attention backend, the KV cache
  dtype, a pipeline partition that leaves a stage without a layer, the tensor-parallel split of the
  heads, quantization, speculative decoding and LoRA (what needs the resolved configuration), plus
  option_policy's refusals read back from the configuration (`refuse_engine_config`).

Where they run:
1. In the front-end, while vLLM builds its configuration: the patched `create_engine_config`, then
   `VexactModelConfig`, registered in vLLM's per-architecture config hooks (`MODELS_CONFIG_MAP`,
   keyed by the resolved architecture, which under `--model-impl vexact` is ours:
   `VllmVexactQwen3ForCausalLM`, ...). vLLM calls `verify_and_update_model_config` at the end of
   `ModelConfig.__post_init__` (after the dtype is resolved from `--dtype` and the checkpoint's
   `dtype`/`torch_dtype`, so a float16 checkpoint under `--dtype auto` is seen as torch.float16) and
   `verify_and_update_config` early in `VllmConfig.__post_init__` (vLLM 0.26, 0.32 and 0.33 alike).
   `vllm serve`, `LLM(...)` and `EngineArgs.create_engine_config()` therefore fail in the calling
   process, before any engine process starts (a ValueError, or a pydantic ValidationError, itself a
   ValueError, carrying the message).
2. In the worker, as a post-condition: `VllmVexactForCausalLM.__init__` runs `refuse_unsupported_engine`
   again on the configuration the worker received.
"""

from __future__ import annotations

import functools
import json
from importlib.metadata import entry_points
from pathlib import Path

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from vexact_vllm.model_impl import MODEL_IMPL
from vexact_vllm.model_patches.config import DecoderConfig, UnsupportedModelError, check_dtype
from vexact_vllm.model_patches.families import BY_MODEL_TYPE
from vexact_vllm.model_patches.pipeline_parallel import pipeline_stages
from vexact_vllm.model_patches.tensor_parallel import check_tensor_parallel

from .option_policy import HYBRID_ENGINE, refuse_engine_args, refuse_engine_config
from .versions import note_version

LOGITS_PROCESSOR_PLUGINS = "vllm.logits_processors"  # vLLM's entry-point group (LOGITSPROCS_GROUP)


def _logits_processor_plugins() -> list[str]:
    return [f"{ep.name} ({ep.value})" for ep in entry_points(group=LOGITS_PROCESSOR_PLUGINS)]


def checkpoint_tensor_names(model: str) -> set[str] | None:
    """The tensor names of a local safetensors checkpoint directory (headers only), else None."""
    path = Path(model)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as handle:
            names.update(handle.keys())
    return names


def refuse_unsupported_model(model_config) -> None:
    """The checkpoint, dtype and model-level options (`model_config.dtype` resolved to a torch.dtype)."""
    config = DecoderConfig.from_hf(model_config.hf_config)
    check_checkpoint = getattr(BY_MODEL_TYPE[config.model_type].load(), "check_checkpoint", None)
    if check_checkpoint is not None and getattr(model_config, "load_format", "auto") != "dummy":
        names = checkpoint_tensor_names(model_config.model)
        if names is not None:
            check_checkpoint(names, config)
    check_dtype(model_config.dtype)
    if model_config.quantization:
        raise UnsupportedModelError(
            f"--quantization {model_config.quantization} is not supported with --model-impl vexact (the "
            "trainer computes in bf16/fp32); serve the unquantized checkpoint without --quantization"
        )
    processors = [getattr(p, "__qualname__", p) for p in model_config.logits_processors or ()]
    plugins = _logits_processor_plugins()
    if processors or plugins:
        where = []
        if processors:
            where.append(f"--logits-processors {', '.join(map(str, processors))}")
        if plugins:
            where.append(f"installed {LOGITS_PROCESSOR_PLUGINS} entry points {', '.join(plugins)}")
        raise UnsupportedModelError(
            f"custom logits processors ({'; '.join(where)}) are not supported with --model-impl vexact: vLLM "
            "runs them inside its own sampler, which the vexact sampler replaces, so they would be ignored "
            "(and a processor that changes the distribution would take the tokens away from the one the "
            "trainer's log-probs describe). Drop --logits-processors (or uninstall the package that "
            "provides the entry point)"
        )


def refuse_unsupported_engine(vllm_config) -> None:
    """Everything `refuse_unsupported_model` refuses, plus the engine options."""
    from .attention import BACKEND_NAME, VexactAttentionBackend

    model_config = vllm_config.model_config
    refuse_unsupported_model(model_config)
    refuse_engine_config(vllm_config)
    attention = getattr(vllm_config, "attention_config", None)
    backends = [getattr(attention, "backend", None), *getattr(attention, "backend_per_kind", {}).values()]
    for backend in backends:
        if backend is not None and getattr(backend, "name", str(backend)) != BACKEND_NAME:
            raise UnsupportedModelError(
                f"--attention-backend {getattr(backend, 'name', backend)} cannot keep rollouts bitwise equal "
                "to the trainer; vexact models use their own attention backend: drop --attention-backend "
                "(and any backend_per_kind entry of --attention-config)"
            )
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(model_config.dtype).removeprefix("torch.")
    if cache_dtype not in VexactAttentionBackend.supported_kv_cache_dtypes or cache_dtype not in ("auto", model_dtype):
        raise UnsupportedModelError(
            f"--kv-cache-dtype {cache_dtype} cannot keep rollouts bitwise equal to the trainer (it would "
            f"round the keys and values the trainer keeps in {model_dtype}); use --kv-cache-dtype auto"
        )
    parallel = vllm_config.parallel_config
    config = DecoderConfig.from_hf(model_config.hf_config)
    if parallel.pipeline_parallel_size > 1:  # every stage must own a layer (vLLM's split or VLLM_PP_LAYER_PARTITION)
        from vllm.distributed.utils import get_pp_indices

        pipeline_stages(config.num_layers, parallel.pipeline_parallel_size, get_pp_indices)
    check_tensor_parallel(config.num_heads, config.num_kv_heads, parallel.tensor_parallel_size)
    if config.linear is not None:
        config.linear.shard(parallel.tensor_parallel_size)  # the linear-attention heads split evenly
        refuse_unsupported_state_cache(vllm_config)
    if getattr(parallel, "enable_expert_parallel", False):
        raise UnsupportedModelError(
            "expert parallelism is not supported yet with --model-impl vexact (each rank would hold other "
            "experts than the trainer's canonical order assumes); drop --enable-expert-parallel"
        )
    if vllm_config.quant_config is not None:
        raise UnsupportedModelError(
            "quantization is not supported with --model-impl vexact (the trainer computes in bf16/fp32); "
            "serve the unquantized checkpoint without --quantization"
        )
    if vllm_config.speculative_config is not None:
        raise UnsupportedModelError(
            "speculative decoding is not supported with --model-impl vexact; drop --speculative-config"
        )
    if vllm_config.lora_config is not None:
        raise UnsupportedModelError(
            "LoRA is not supported with --model-impl vexact; merge the adapter into the checkpoint and "
            "serve it without --enable-lora"
        )


def refuse_unsupported_state_cache(vllm_config) -> None:
    """A hybrid model's (Gated DeltaNet layers: Qwen3-Next, Qwen3.5) engine options: prefix caching only at
    option_policy.HYBRID_ENGINE's value, and the state caches' dtypes are the model's (state_cache.py)."""
    cache = vllm_config.cache_config
    values = {"enable_prefix_caching": cache.enable_prefix_caching}
    for option, (allowed, message) in HYBRID_ENGINE.items():
        if values[option] != allowed:
            raise UnsupportedModelError(message)
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    for option, value, allowed in (("--mamba-cache-dtype", cache.mamba_cache_dtype, ("auto", model_dtype)),
                                   ("--mamba-ssm-cache-dtype", cache.mamba_ssm_cache_dtype, ("auto", "float32"))):  # fmt: skip
        if value not in allowed:
            raise UnsupportedModelError(
                f"{option} {value} cannot keep rollouts bitwise equal to the trainer: vexact keeps the Gated "
                f"DeltaNet conv state in the model dtype and the recurrent state in float32; drop {option}"
            )


def text_positions(model_config) -> None:
    """Qwen3.5's configs carry multimodal rotary fields (`mrope_section`, `mrope_interleaved`) in their
    text config's rope parameters, which make vLLM's runner build three position rows per token (time,
    height, width) and ask the model for vLLM's M-RoPE interface. vexact serves these checkpoints text
    only, where a token's three positions are one and the same and the rotation is the plain one the
    trainer runs (model_patches/hybrid.py); so the fields are dropped from vLLM's copy of the config
    (never from the checkpoint), and vLLM gives the model one position per token. Image and video
    inputs are refused at admission (request_validation.py)."""
    from vllm.transformers_utils.config import uses_mrope

    from vexact_vllm.model_patches.config import MROPE_FIELDS

    hf_config = model_config.hf_config
    for config in {id(c): c for c in (hf_config, hf_config.get_text_config(), model_config.hf_text_config)}.values():
        params = getattr(config, "rope_parameters", None)
        if not isinstance(params, dict):
            continue
        nested = params and all(isinstance(v, dict) or v is None for v in params.values())  # per layer type
        for rope in params.values() if nested else [params]:
            if rope:
                for name in MROPE_FIELDS:
                    rope.pop(name, None)
    if uses_mrope(hf_config):
        raise UnsupportedModelError(
            "this checkpoint asks vLLM for multimodal rotary positions in a way vexact-vllm does not read "
            "(mrope_section outside the rope parameters); serve a checkpoint whose text config keeps "
            "mrope_section in rope_parameters, as Qwen3.5's do"
        )


class VexactModelConfig(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hooks for every vexact architecture (registry.register_models)."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        refuse_unsupported_model(model_config)
        text_positions(model_config)

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        refuse_unsupported_engine(vllm_config)


def wrap_create_engine_config(original):
    """`EngineArgs.create_engine_config` (a row of vllm_patches.py): under `--model-impl vexact`, the
    allow-list's refusals before vLLM builds anything, and the version note."""

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        if getattr(self, "model_impl", None) == MODEL_IMPL:
            note_version()
            refuse_engine_args(self)
        return original(self, *args, **kwargs)

    return create_engine_config
