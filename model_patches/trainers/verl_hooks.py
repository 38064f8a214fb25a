"""verl's actor scores vexact models with the one log-prob function (verl 0.9.1, FSDP engine).

Where verl computes actor log-probs: `FSDPEngineWithLMHead.forward_step` (verl's own FSDP engine,
also the base of its VeOmni engine) calls `prepare_model_inputs`, the model, then
`prepare_model_outputs`. Two paths there, picked by the micro-batch's `use_fused_kernels`:
- unfused (verl's default): the model returns logits [1, T, V]; verl divides them by the temperature
  in the logits' dtype (`_scale_logits_by_temperature`, skipped at 1.0), then
  `verl_F.logprobs_from_logits` (flash-attn cross-entropy or torch logsumexp) and
  `entropy_from_logits`: a second log-softmax, not ours;
- fused: the model is called with `temperature=` (a float) and `shift_labels=` (the packed targets)
  and returns `log_probs` and `entropy` itself (verl's `CausalLMOutputForPPO` contract); verl then
  only unpads and re-nests them. verl's own fused forward (`dense_common.forward_with_*_backend`)
  is swapped onto the model class by `patch_forward_with_backends`.

What `install()` changes (`PATCHES`, one row each, checked against verl's signatures at install and
undone by `uninstall()`; every one acts only when the module is a vexact model, so stock models run
verl's code untouched):
1. `FSDPEngineWithLMHead.prepare_model_inputs`: for a vexact module the micro-batch is marked
   `use_fused_kernels=True`, so verl takes its fused path (both in prepare_model_inputs and in
   prepare_model_outputs); the model gets `return_entropy` (verl's `calculate_entropy`) and
   `vocab_mask` (below). The vexact forward implements the fused contract with
   `kernels.linear_token_log_probs` (log-probs, with its gradient) and the entropy of
   `kernels.log_softmax` (ppo_outputs.py). verl never sees logits, so it never divides
   them by the temperature and never runs its own log-softmax.
2. `monkey_patch.patch_forward_with_backends`: leaves vexact classes alone (with
   `use_fused_kernels=True` verl would otherwise replace their forward with its own).
3. `RolloutConfig.__post_init__`: verl refuses `rollout.pipeline_model_parallel_size > 1` for every
   vLLM rollout and never passes a pipeline size to its vLLM server (its replicas already count the
   pipeline's GPUs: TP x DP x PP per replica). For a vLLM rollout with `--model-impl vexact`
   (`engine_kwargs.vllm.model_impl`) the row lets the size through verl's check and writes it into
   `engine_kwargs.vllm.pipeline_parallel_size`, which the server spreads into the vLLM arguments it
   builds (`vLLMHttpServer.launch_server`); any other rollout meets verl's refusal unchanged. verl
   builds this config in its agent-loop workers before it imports `external_lib`, so a pipelined run
   turns the training side on in every verl process (`VERL_USE_EXTERNAL_MODULES`, see the recipe).

Temperature (one definition, kernels/sampling/logprob.py's, as the rollout): the lm_head GEMM writes fp32
logits z; scaled = z / tau by fp32 true division with tau an fp32 tensor, applied exactly once,
inside the log-prob function; tau == 0 (greedy) scores at 1. verl's own definition (divide the
logits in their dtype, bf16 for stock models, before its fp32 cast, clamp tau >= 1e-8) is not
used for vexact models: verl hands the float temperature to the model and divides nothing.

Vocabulary masking: verl's vLLM rollout wraps the model's `compute_logits`
(`monkey_patch_compute_logits`) and sets the logits of ids >= len(tokenizer) and of the vision
placeholder ids (`get_vision_placeholder_token_ids(processor)`, none for text models) to -inf;
our vLLM model's `compute_logits` returns the fp32 lm_head logits and our samplers take
`log_softmax` of exactly those masked logits. The trainer builds the same set from the engine's
own tokenizer and processor (the same HF path and verl functions as the rollout) and passes it as
`vocab_mask` to `linear_token_log_probs`, which sets those fp32 logits to -inf right after the GEMM,
before the temperature: the same ids, the same place, so the normalisers agree bit for bit.

Refused for vexact models, with what to change: Ulysses sequence parallelism, per-sample
temperature tensors, top-k distillation, `calculate_sum_pi_squared` (all need full logits or
sliced sequences), and a vexact model class whose forward takes no `vocab_mask` while the
tokenizer is shorter than the vocabulary.
"""

from __future__ import annotations

import inspect

import torch

from vexact_vllm.model_impl import MODEL_IMPL
from vexact_vllm.patching import Patch, PatchTable

from .hf_causal_lm import VexactForCausalLM

_UNSET = object()


def _vexact_model(module) -> VexactForCausalLM | None:
    """The vexact model inside verl's engine module (plain, FSDP2, FSDP1 or PEFT-wrapped), or None."""
    seen = 0
    while module is not None and seen < 8:
        if isinstance(module, VexactForCausalLM):
            return module
        if hasattr(module, "get_base_model"):  # PEFT
            module = module.get_base_model()
        else:
            module = getattr(module, "_fsdp_wrapped_module", None) or getattr(module, "module", None)
        seen += 1
    return None


def _refuse_unsupported(engine, micro_batch) -> None:
    from verl.utils import tensordict_utils as tu

    get = lambda key, default=False: tu.get_non_tensor_data(data=micro_batch, key=key, default=default)  # noqa: E731
    if getattr(engine, "use_ulysses_sp", False):
        raise ValueError(
            "vexact models do not support Ulysses sequence parallelism: each rank would attend within "
            "its own slice. Set actor_rollout_ref.actor.ulysses_sequence_parallel_size=1."
        )
    if isinstance(micro_batch["temperature"], torch.Tensor):
        raise ValueError(
            "per-sample temperature tensors are not supported with vexact models; set one "
            "actor_rollout_ref.rollout.temperature for the batch"
        )
    if get("distillation_use_topk"):
        raise ValueError("top-k distillation needs verl's logits path; it is not supported with vexact models")
    if get("calculate_sum_pi_squared"):
        raise ValueError(
            "calculate_sum_pi_squared needs the full logits, which vexact models never materialise; "
            "set actor_rollout_ref.actor.calculate_sum_pi_squared=False"
        )


def rollout_vocab_mask(model_config, vocab_size: int, device) -> torch.Tensor | None:
    """bool [V]: the ids verl's vLLM rollout leaves finite (False: ids >= len(tokenizer) and vision
    placeholders), from the same tokenizer/processor and verl function; None if nothing is masked."""
    from verl.workers.rollout.utils import get_vision_placeholder_token_ids

    tokenizer = getattr(model_config, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "verl's vLLM rollout masks the ids past len(tokenizer); the vexact trainer needs the same "
            "tokenizer to mask them too. Load it (actor_rollout_ref.model.load_tokenizer=True)."
        )
    mask = torch.arange(vocab_size, device=device) < len(tokenizer)
    banned = get_vision_placeholder_token_ids(getattr(model_config, "processor", None))
    if banned:
        mask[torch.tensor(banned, dtype=torch.long, device=device)] = False
    return None if bool(mask.all()) else mask


def _engine_vocab_mask(engine, model: VexactForCausalLM, device) -> torch.Tensor | None:
    cached = getattr(engine, "_vexact_vocab_mask", _UNSET)
    if cached is _UNSET or (cached is not None and cached.device != device):
        cached = rollout_vocab_mask(engine.model_config, model.config.vocab_size, device)
        engine._vexact_vocab_mask = cached
    return cached


def _wrap_prepare_model_inputs(original):
    def prepare_model_inputs(self, micro_batch):
        model = _vexact_model(self.module)
        if model is None:
            return original(self, micro_batch)
        from verl.utils import tensordict_utils as tu

        _refuse_unsupported(self, micro_batch)
        tu.assign_non_tensor(micro_batch, use_fused_kernels=True)  # verl's fused path, both halves
        model_inputs, output_args = original(self, micro_batch)
        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        mask = _engine_vocab_mask(self, model, model_inputs["input_ids"].device)
        accepted = inspect.signature(type(model).forward).parameters
        if "return_entropy" in accepted:
            model_inputs["return_entropy"] = bool(calculate_entropy)
        if "vocab_mask" in accepted:
            model_inputs["vocab_mask"] = mask
        elif mask is not None:
            raise ValueError(
                f"{type(model).__name__}.forward takes no vocab_mask, but verl's rollout masks "
                f"{int((~mask).sum())} ids (past len(tokenizer)): the trainer would normalise over ids "
                "the rollout never samples. Give the model class's forward a vocab_mask argument."
            )
        return model_inputs, output_args

    return prepare_model_inputs


def _wrap_patch_forward_with_backends(original):
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if isinstance(model, VexactForCausalLM):
            return None  # the vexact forward already returns verl's fused outputs from the shared function
        return original(model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend)

    return patch_forward_with_backends


def vexact_vllm_rollout(config) -> bool:
    """Whether verl's rollout config asks for vLLM with `--model-impl vexact`."""
    engine_kwargs = getattr(config, "engine_kwargs", None) or {}
    return config.name == "vllm" and (engine_kwargs.get("vllm") or {}).get("model_impl") == MODEL_IMPL


def _wrap_rollout_post_init(original):
    def __post_init__(self):
        size = self.pipeline_model_parallel_size
        if size <= 1 or not vexact_vllm_rollout(self):
            return original(self)
        vllm_kwargs = self.engine_kwargs["vllm"]
        asked = vllm_kwargs.get("pipeline_parallel_size")
        if asked not in (None, size):
            raise ValueError(
                f"actor_rollout_ref.rollout.pipeline_model_parallel_size={size} but "
                f"engine_kwargs.vllm.pipeline_parallel_size={asked}; set only the first (verl sizes each "
                "rollout replica from it)"
            )
        object.__setattr__(self, "pipeline_model_parallel_size", 1)  # past verl's refusal of any vLLM pipeline
        try:
            original(self)
        finally:
            object.__setattr__(self, "pipeline_model_parallel_size", size)
        vllm_kwargs["pipeline_parallel_size"] = size  # the vLLM server's --pipeline-parallel-size
        return None

    return __post_init__


WRITTEN_FOR = "verl 0.9.1"

# The whole patch set, one row per target (vexact_vllm.patching).
PATCHES = PatchTable(
    "verl",
    (
        Patch("verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_inputs",
              _wrap_prepare_model_inputs, ("self", "micro_batch"), WRITTEN_FOR),
        Patch("verl.models.transformers.monkey_patch:patch_forward_with_backends",
              _wrap_patch_forward_with_backends, ("model", "use_fused_kernels", "fused_kernels_backend"),
              WRITTEN_FOR),
        Patch("verl.workers.config.rollout:RolloutConfig.__post_init__", _wrap_rollout_post_init, ("self",),
              WRITTEN_FOR),
    ),
)  # fmt: skip

install = PATCHES.install  # apply the patches (idempotent; a PatchError if verl's targets changed)
uninstall = PATCHES.uninstall  # restore verl's originals
is_installed = PATCHES.is_installed
installed = PATCHES.installed
