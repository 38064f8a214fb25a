"""The training-side wrapper: a Hugging Face `PreTrainedModel` around the shared decoder.

`from_pretrained` loads Hugging Face safetensors checkpoints unchanged (parameter names are
Hugging Face's), the forward has a gradient, and the log-probs go through the one log-prob function
(`kernels.sampling.logprob`), fused with the lm_head GEMM so full-vocabulary logits are never materialised
for the whole batch. Batches may be padded (`attention_mask`) or packed (`position_ids` that reset
to 0 at each sequence start); both are turned into the packed layout the shared model runs on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from vexact_vllm.kernels import linear, linear_token_log_probs

from ..attention_context import PackedAttention, cu_seqlens_from_position_ids
from ..config import DecoderConfig, check_dtype
from ..families import FAMILIES, Family
from ..gated_delta import GatedDeltaNet
from ..gated_delta import init_weights as init_gated_delta
from ..layers import Embedding, Linear, RMSNorm, ZeroCentredRMSNorm
from ..models import build_decoder
from ..moe import Experts, Router
from .autocast import follows_autocast
from .ppo_outputs import token_log_probs_and_entropy


@dataclass
class VexactPPOOutput(CausalLMOutputWithPast):
    """verl's fused-kernel model output (`CausalLMOutputForPPO`): per-token log-probs and entropy."""

    log_probs: torch.FloatTensor | None = None
    entropy: torch.FloatTensor | None = None


def token_ids(ids: torch.Tensor) -> torch.Tensor:
    """`ids` as an integer tensor the embedding takes; float, complex or bool ids are refused (a cast
    to int would silently truncate 3.7 to 3). Ids against the vocabulary: `check_in_vocabulary`."""
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"token ids must be integers, got {ids.dtype} ids; pass the tokenizer's ids as int64 "
            "(a float or bool id is not a token)"
        )
    return ids if ids.dtype in (torch.int64, torch.int32) else ids.long()


def check_in_vocabulary(ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse a batch with no tokens, or an id outside [0, vocab_size). One min/max reduction and
    one host sync per call (the trainer calls it once per forward)."""
    if ids.numel() == 0:
        raise ValueError(
            "no tokens to score: every sequence is empty or fully padded (attention_mask all 0); "
            "pass at least one token"
        )
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size}) of this model: "
            "check that the tokenizer matches the checkpoint, and mark padding 0 in attention_mask "
            "(a padding id such as -100 may only sit where the mask drops it)"
        )


class PackedBatch:
    """input_ids [T], positions [T], cu_seqlens [B+1] and where each packed row came from."""

    def __init__(self, input_ids, positions, cu_seqlens, index=None, shape=None):
        self.input_ids, self.positions, self.cu_seqlens = input_ids, positions, cu_seqlens
        self.index, self.shape = index, shape  # flat indices into the [B, L] input, or None

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], device=None) -> PackedBatch:
        """Sequences of token ids (lists, tuples, 1-D integer arrays or tensors), each non-empty."""
        if len(sequences) == 0:
            raise ValueError("no sequences: PackedBatch.from_sequences needs at least one sequence of token ids")
        lengths = torch.tensor([len(s) for s in sequences])
        if not bool(lengths.all()):
            empty = int(torch.nonzero(lengths == 0)[0])
            raise ValueError(
                f"sequence {empty} is empty: a sequence of length 0 has no token to score; drop it from the batch"
            )
        ids = token_ids(torch.tensor([t for s in sequences for t in s])).long().to(device)
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device)
        cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        return cls(ids, positions, cu.to(device))  # [T], [T], [B+1] on `device`

    @classmethod
    def from_hf_inputs(cls, input_ids, attention_mask=None, position_ids=None) -> PackedBatch:
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [B, L] (batch, length), got shape {tuple(input_ids.shape)}; "
                "give one sequence as input_ids[None]"
            )
        input_ids = token_ids(input_ids)
        b, length = input_ids.shape
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.bool()
            runs = (mask[:, 1:] & ~mask[:, :-1]).sum(-1) + mask[:, 0]
            if bool((runs > 1).any()):
                raise ValueError("attention_mask must mark one contiguous run of tokens per row")
            index = torch.nonzero(mask.reshape(-1)).reshape(-1)
            positions = (mask.cumsum(-1) - 1).reshape(-1)[index]
            cu = torch.zeros(b + 1, dtype=torch.int32, device=input_ids.device)
            cu[1:] = torch.cumsum(mask.sum(-1), 0)
            return cls(input_ids.reshape(-1)[index], positions, cu, index, (b, length))
        if position_ids is not None:
            positions = position_ids.expand(b, length).reshape(-1)
            return cls(input_ids.reshape(-1), positions, cu_seqlens_from_position_ids(positions), None, (b, length))
        positions = torch.arange(length, device=input_ids.device).repeat(b)
        cu = torch.arange(0, b * length + 1, length, dtype=torch.int32, device=input_ids.device)
        return cls(input_ids.reshape(-1), positions, cu, None, (b, length))

    def next_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Target of row t is the token at t+1 of the same sequence; returns (targets, valid)."""
        targets = torch.roll(self.input_ids, -1)
        valid = torch.ones_like(self.input_ids, dtype=torch.bool)
        valid[self.cu_seqlens[1:].long() - 1] = False  # the last token of each sequence
        return torch.where(valid, targets, torch.zeros_like(targets)), valid

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, L, ...] (zeros where the input was padding)."""
        b, length = self.shape
        if self.index is None:
            return packed.reshape(b, length, *packed.shape[1:])
        out = packed.new_zeros(b * length, *packed.shape[1:])
        out[self.index] = packed
        return out.reshape(b, length, *packed.shape[1:])


@contextmanager
def collect_router_logits(model: torch.nn.Module, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """Within the block, every MoE router of `model` appends its fp32 logits [T, E] to the yielded
    list, in execution (layer) order; hooks removed on exit. Nothing is collected when not `enabled`."""
    logits: list[torch.Tensor] = []
    routers = [m for m in model.modules() if isinstance(m, Router)] if enabled else []
    handles = [r.register_forward_hook(lambda module, args, out: logits.append(out)) for r in routers]
    try:
        yield logits
    finally:
        for h in handles:
            h.remove()


class VexactPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    supports_gradient_checkpointing = True  # Decoder.forward checkpoints each layer
    _supports_attention_backend = False
    hf_architecture = ""  # the Hugging Face class this one stands in for, written to saved configs
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # DeepSeek-V3's router bias, as transformers

    def save_pretrained(self, save_directory, *args, **kwargs):
        """A checkpoint names Hugging Face's architecture (e.g. Qwen3ForCausalLM), not this class, so
        vLLM (stock or `--model-impl vexact`), transformers and verl load what a trainer saved."""
        super().save_pretrained(save_directory, *args, **kwargs)
        self.config.architectures = [self.hf_architecture]
        if kwargs.get("is_main_process", True):
            self.config.save_pretrained(save_directory)

    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, **kwargs):
        """The shared model always runs the vexact varlen attention kernel; Hugging Face's attention
        selection (verl's FSDP engine asks for flash_attention_2) is recorded but not consulted."""
        return attn_implementation or "eager"

    def _check_and_adjust_experts_implementation(self, experts_implementation=None, *args, **kwargs):
        """The shared model's experts always run `kernels.fused_moe`; transformers' experts selection
        (grouped_mm, batched_mm) is recorded, not consulted."""
        return experts_implementation or "eager"

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, Experts):
            module.gate_up_proj.data.normal_(0.0, std)
            module.down_proj.data.normal_(0.0, std)
        elif isinstance(module, (Linear, Embedding, Router)):
            module.weight.data.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.data.zero_()
        elif isinstance(module, GatedDeltaNet):
            init_gated_delta(module, std)  # its own tensors; its Linears and norm are visited on their own
        elif isinstance(module, ZeroCentredRMSNorm):
            module.weight.data.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)


class VexactForCausalLM(VexactPreTrainedModel):
    """Shared decoder + lm_head. `forward` is Hugging Face's causal-LM forward (fp32 logits);
    `packed_log_probs` is what an RL trainer should call."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.decoder_config = DecoderConfig.from_hf(config)
        self.model = build_decoder(self.decoder_config)
        # The decoder's sizes: a vision-language config keeps them in its text config.
        self.lm_head = Linear(self.decoder_config.hidden_size, self.decoder_config.vocab_size)
        self.post_init()

    def hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        check_dtype(self.lm_head.weight.dtype)
        check_in_vocabulary(batch.input_ids, self.decoder_config.vocab_size)
        return self.model(batch.input_ids, batch.positions, PackedAttention(batch.cu_seqlens))  # [T, H]

    @follows_autocast
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        labels=None,
        *,
        temperature=None,
        shift_labels=None,
        return_entropy: bool = True,
        vocab_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        """Hugging Face's causal-LM forward (fp32 logits [B, L, V]), or, when `temperature` or
        `shift_labels` is given, verl's fused-kernel output: per-token `log_probs` and `entropy`
        [B, L] of the targets `shift_labels` (else input_ids shifted left by one in each row) from
        the one log-prob function (see ppo_outputs). `vocab_mask` (bool [V]): ids the rollout masked.
        Autocast is off inside: the shared kernels fix their own dtypes, as on the rollout side; an
        enclosing bf16 autocast over fp32 parameters runs the forward on their bf16 casts (autocast.py)."""
        if input_ids is None:
            raise ValueError("vexact models take input_ids (inputs_embeds is not supported)")
        batch = PackedBatch.from_hf_inputs(input_ids, attention_mask, position_ids)
        ppo = temperature is not None or shift_labels is not None
        router = kwargs.get("output_router_logits", getattr(self.config, "output_router_logits", False))
        router = bool(router) and self.decoder_config.moe is not None and not ppo
        with collect_router_logits(self.model, router) as router_logits:
            hidden = self.hidden_states(batch)  # [T, H]
        if ppo:  # the log-probs never depend on the router's auxiliary loss
            return self._ppo_outputs(batch, hidden, input_ids, shift_labels, temperature, return_entropy, vocab_mask)
        logits = batch.unpack(linear(hidden, self.lm_head.weight, out_dtype=torch.float32))  # [B, L, V]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.decoder_config.vocab_size)
        if not router:
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        if not hasattr(self.config, "router_aux_loss_coef"):  # DeepSeek: transformers returns the logits, no aux loss
            return MoeCausalLMOutputWithPast(loss=loss, logits=logits, router_logits=tuple(router_logits))
        aux_loss = self._load_balancing_loss(router_logits)
        if loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, router_logits=tuple(router_logits))

    def _load_balancing_loss(self, router_logits: list[torch.Tensor]) -> torch.Tensor:
        """Hugging Face's auxiliary loss of its Qwen3-MoE (`load_balancing_loss_func`), on the fp32
        router logits of the packed tokens (padding is never among them: no mask needed)."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        moe = self.decoder_config.moe
        return load_balancing_loss_func(tuple(router_logits), moe.num_experts, moe.top_k, None)

    def _ppo_outputs(self, batch, hidden, input_ids, shift_labels, temperature, return_entropy, vocab_mask):
        targets = shift_labels if shift_labels is not None else torch.roll(input_ids, -1, dims=-1)  # [B, L]
        if tuple(targets.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"shift_labels {tuple(targets.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
            )
        targets = targets.reshape(-1) if batch.index is None else targets.reshape(-1)[batch.index]  # [T]
        tau = 1.0 if temperature is None else temperature
        log_probs, entropy = token_log_probs_and_entropy(
            hidden, self.lm_head.weight, targets, tau, vocab_mask, return_entropy
        )
        return VexactPPOOutput(
            log_probs=batch.unpack(log_probs), entropy=None if entropy is None else batch.unpack(entropy)
        )

    @follows_autocast
    def packed_log_probs(self, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
        """log p(token t+1 | tokens <= t) for every packed row t, fp32 [T]; 0 at each sequence's
        last row. The same function, temperature and GEMM as the rollout (see kernels.sampling.logprob).
        Autocast is off inside, and a bf16 autocast over fp32 parameters runs on their bf16 casts,
        as in `forward`."""
        hidden = self.hidden_states(batch)
        targets, valid = batch.next_tokens()
        logp = linear_token_log_probs(hidden, self.lm_head.weight, targets, temperature)
        return torch.where(valid, logp, torch.zeros_like(logp))


def share_checkpoint_conversion(family: Family, class_name: str) -> None:
    """Give `class_name` the checkpoint conversions transformers applies to the family's own class
    (Qwen3-MoE: per-expert tensors on disk <-> stacked `gate_up_proj`/`down_proj` in memory, on load
    and, reversed, on save). transformers skips the model-type mapping for classes defined outside
    it; `register_checkpoint_conversion_mapping` is its API for classes like ours. A vision-language
    row's class holds the language model alone: its text model's conversions (Qwen3.5's
    `model.language_model.*` on disk <-> `model.*`)."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    model_type = family.model_type
    if family.text_config:
        model_type = family.hf_config_class().sub_configs["text_config"].model_type
    mapping = get_checkpoint_conversion_mapping(model_type)
    if mapping is not None:
        register_checkpoint_conversion_mapping(class_name, mapping, overwrite=True)


def _training_class(family: Family) -> type[VexactForCausalLM]:
    """The family's training class `Vexact<Architecture>`: VexactForCausalLM for its config class."""
    share_checkpoint_conversion(family, family.training_name)
    return type(family.training_name, (VexactForCausalLM,), {
        "config_class": family.hf_config_class(), "hf_architecture": family.architecture, "__module__": __name__,
        "__qualname__": family.training_name, "__doc__": f"The shared {family.architecture} for trainers.",
    })  # fmt: skip


# model_type -> training class, one per row of the family table.
TRAINING_CLASSES: dict[str, type[VexactForCausalLM]] = {f.model_type: _training_class(f) for f in FAMILIES}
_BY_NAME = {cls.__name__: cls for cls in TRAINING_CLASSES.values()}


def __getattr__(name: str):
    """The family classes by name (`from vexact_vllm.model_patches.trainers.hf_causal_lm import
    VexactQwen3ForCausalLM`; pickling finds them the same way)."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
