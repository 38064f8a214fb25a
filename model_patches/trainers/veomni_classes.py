"""The shared model as VeOmni builds it: VeOmni's modeling contract on top of the vexact classes.

VeOmni's generated `*ForCausalLM.forward` computes the last hidden states, then hands them with
the lm_head weight to a loss wrapper that VeOmni picks (the `cross_entropy_loss` OpSlot, else
`self.loss_function`, i.e. transformers' `LOSS_MAPPING`). With `return_log_probs=True` (what verl's
`model_engine=veomni` sends) the wrapper returns per-token log-probs and entropy in a
`FusedLinearAuxOutput` instead of a loss. The classes here speak the same contract, with one loss
wrapper, `vexact_causal_lm_loss`, whose log-probs are `kernels.linear_token_log_probs`: the one
log-prob function the rollout uses, temperature applied once inside it (fp32 logits divided by an
fp32 temperature), so neither VeOmni nor verl divides the logits a second time.

Kernel selection. This module declares VeOmni's causal-LM loss OpSlot, so VeOmni binds it from
`OpsImplementationConfig.cross_entropy_loss_implementation` when it builds one of these models;
`veomni_hooks.install()` registers `vexact_causal_lm_loss` under the name "vexact". "eager" (VeOmni's
"the model's own code") and "vexact" both mean this wrapper; any other loss kernel, and any other
non-eager per-op kernel (rms_norm, swiglu_mlp, rotary_pos_emb: the shared model always runs the
vexact ones), is refused at build time. The attention implementation name is not consulted: the
shared model's attention is the vexact varlen kernel; sequence/context parallelism is refused.
"""

from __future__ import annotations

import torch
from veomni.ops.dispatch import OpSlot
from veomni.utils.model_outputs import CausalLMOutputWithLogProbs, FusedLinearAuxOutput

from ..families import BY_MODEL_TYPE
from .autocast import follows_autocast
from .hf_causal_lm import TRAINING_CLASSES, PackedBatch, share_checkpoint_conversion
from .ppo_outputs import token_log_probs_and_entropy

# VeOmni binds every OpSlot of a model's module at build time (`_bind_veomni_ops`).
veomni_causal_lm_loss = OpSlot("cross_entropy_loss", "causal")

VEXACT_KERNEL_NAME = "vexact"
# Per-op selections VeOmni offers for these model types that the shared model does not consult.
_FIXED_OPS = ("rms_norm_implementation", "swiglu_mlp_implementation", "rotary_pos_emb_implementation")


def _targets(labels, shift_labels, ignore_index):
    """(targets [T] for every hidden row, -1 where ignored; valid [T]): VeOmni's label convention."""
    if shift_labels is None:  # causal shift here; the last row of each row of `labels` has no target
        shift_labels = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
    flat = shift_labels.reshape(-1)
    valid = flat != ignore_index
    return torch.where(valid, flat, torch.full_like(flat, -1)), valid


def _refuse_sequence_parallel() -> None:
    from veomni.distributed.parallel_state import get_parallel_state, is_parallel_state_initialized

    if is_parallel_state_initialized() and get_parallel_state().sp_enabled:
        raise ValueError(
            "vexact models do not support VeOmni sequence/context parallelism (ulysses_size or "
            "cp_size > 1): each rank would attend within its own slice. Set ulysses_parallel_size=1."
        )


def vexact_causal_lm_loss(
    logits=None,
    labels=None,
    vocab_size=None,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    *,
    hidden_states=None,
    weights=None,
    return_log_probs: bool = False,
    temperature=1.0,
    vocab_mask=None,
    return_entropy=None,
    **kwargs,
):
    """VeOmni's causal-LM loss-wrapper contract -> (loss, logits, FusedLinearAuxOutput | None).

    hidden_states [B, L, H] (or [L, H]), weights [V, H] (the lm_head), labels [B, L]; `shift_labels`
    pre-shifted targets (verl passes them), else labels shifted by one here. return_log_probs: per
    token log p(target) and entropy, shaped like the labels, 0 where the target is ignore_index.
    Otherwise the cross-entropy loss (sum / num_items_in_batch, or the mean), at temperature 1.
    vocab_mask: bool [V], the ids verl's rollout leaves finite (verl_hooks passes it); return_entropy:
    False skips the entropy (verl's calculate_entropy), None computes it as VeOmni's contract does.
    Log-probs and entropy are `ppo_outputs.token_log_probs_and_entropy`, verl's fused path's own.
    """
    if kwargs.get("teacher_topk_ids") is not None or kwargs.get("teacher_topk_log_probs") is not None:
        raise ValueError("top-k distillation is not supported by the vexact log-prob path; unset distillation")
    if hidden_states is None or weights is None:
        raise ValueError("vexact_causal_lm_loss needs hidden_states and weights (the fused lm_head path)")
    if labels is None and shift_labels is None:
        raise ValueError("vexact_causal_lm_loss needs labels or shift_labels")
    _refuse_sequence_parallel()
    shape = (shift_labels if shift_labels is not None else labels).shape
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
    targets, valid = _targets(labels, shift_labels, ignore_index)  # [T], [T]; -1 targets score 0
    targets, valid = targets.to(hidden.device), valid.to(hidden.device)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{targets.shape[0]} targets for {hidden.shape[0]} hidden rows")
    tau = temperature if return_log_probs else 1.0
    with_entropy = return_log_probs and return_entropy is not False
    logp, entropy = token_log_probs_and_entropy(hidden, weights, targets, tau, vocab_mask, with_entropy)
    if return_log_probs:
        entropy = None if entropy is None else entropy.reshape(shape)
        return None, None, FusedLinearAuxOutput(log_probs=logp.reshape(shape), entropy=entropy)
    denom = num_items_in_batch if num_items_in_batch is not None else valid.sum().clamp(min=1)
    return -logp.sum() / denom, None, None


def check_ops_config(ops_config) -> None:
    """Refuse VeOmni kernel selections the shared model would not honour (run at build time)."""
    if ops_config is None:
        return
    chosen = getattr(ops_config, "cross_entropy_loss_implementation", "eager")
    if chosen not in ("eager", VEXACT_KERNEL_NAME):
        raise ValueError(
            f"cross_entropy_loss_implementation={chosen!r}: the trainer's log-probs would come from a "
            "different function than the rollout's. Set it to 'vexact' (or 'eager', which means the "
            "same for vexact models)."
        )
    for name in _FIXED_OPS:
        chosen = getattr(ops_config, name, "eager")
        if chosen != "eager":
            raise ValueError(
                f"{name}={chosen!r}: vexact models always run the vexact kernel for this op, so the "
                "selection would be ignored. Set it to 'eager' (the model's own code)."
            )


class VeOmniVexactMixin:
    """VeOmni's forward contract for a vexact training class (see the module docstring)."""

    @classmethod
    def _from_config(cls, config, **kwargs):
        from veomni.ops.config.singleton import get_ops_config

        _refuse_sequence_parallel()
        check_ops_config(get_ops_config())
        bound = veomni_causal_lm_loss.bound_kernel()
        if bound is not None and bound is not vexact_causal_lm_loss:
            raise ValueError(f"VeOmni bound {bound!r} as the loss of a vexact model; select 'vexact'")
        kwargs.pop("attn_implementation", None)  # the shared model's attention is not selectable
        return super()._from_config(config, **kwargs)

    @follows_autocast
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        labels=None,
        shift_labels=None,
        return_log_probs: bool = False,
        temperature=1.0,
        vocab_mask=None,
        return_entropy=None,
        **kwargs,
    ):
        if input_ids is None:
            raise ValueError("vexact models take input_ids (inputs_embeds is not supported)")
        # The shared model sets its own dtypes, as the rollout does: a trainer's autocast (verl's
        # forward_step enters one) must not recast its ops, so follows_autocast has turned it off
        # here, and over fp32 parameters (VeOmni on one rank: no FSDP mixed precision) cast them to bf16.
        if labels is None and shift_labels is None:
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            return CausalLMOutputWithLogProbs(logits=out.logits)
        kwargs.update(vocab_mask=vocab_mask, return_entropy=return_entropy)
        return self._loss_forward(input_ids, attention_mask, position_ids, labels, shift_labels,
                                  return_log_probs, temperature, kwargs)

    def _loss_forward(self, input_ids, attention_mask, position_ids, labels, shift_labels,
                      return_log_probs, temperature, kwargs):
        batch = PackedBatch.from_hf_inputs(input_ids, attention_mask, position_ids)
        hidden = batch.unpack(self.hidden_states(batch))  # [B, L, H]; cu_seq_lens_* follow position_ids
        loss_fn = veomni_causal_lm_loss if veomni_causal_lm_loss.use_non_eager_impl else vexact_causal_lm_loss
        loss, _, aux = loss_fn(
            labels=labels,
            vocab_size=self.config.vocab_size,
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            shift_labels=shift_labels,
            hidden_states=hidden,
            weights=self.lm_head.weight,
            return_log_probs=return_log_probs,
            temperature=temperature,
            teacher_topk_ids=kwargs.get("teacher_topk_ids"),
            teacher_topk_log_probs=kwargs.get("teacher_topk_log_probs"),
            vocab_mask=kwargs["vocab_mask"],
            return_entropy=kwargs["return_entropy"],
        )
        return CausalLMOutputWithLogProbs(loss=loss, fused_linear_aux=aux)


def _veomni_class(model_type: str, training_class: type) -> type:
    """`VeOmni<training class name>`: the family's training class with VeOmni's contract."""
    name = f"VeOmni{training_class.__name__}"
    share_checkpoint_conversion(BY_MODEL_TYPE[model_type], name)
    return type(name, (VeOmniVexactMixin, training_class), {"__module__": __name__, "__qualname__": name})


# model_type -> the class VeOmni's modeling registry returns for its causal-LM architecture.
VEOMNI_CLASSES = {model_type: _veomni_class(model_type, cls) for model_type, cls in TRAINING_CLASSES.items()}
_BY_NAME = {cls.__name__: cls for cls in VEOMNI_CLASSES.values()}


def __getattr__(name: str):
    """The family classes by name (and for pickling)."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
