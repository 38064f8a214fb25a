"""The one configuration the shared model definitions read, built from a Hugging Face config.

Both sides (vLLM and the trainer) build their model from `DecoderConfig.from_hf(hf_config)`, so a
setting either side could read differently (head_dim, rope parameters, tied embeddings) is decided
once here. Anything the shared definitions cannot reproduce bit for bit is refused with a message
that says what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .families import BY_MODEL_TYPE, FAMILIES

# model_type -> the Hugging Face architecture name it serves (the family table, families.py).
SUPPORTED_MODEL_TYPES = {f.model_type: f.architecture for f in FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(SUPPORTED_MODEL_TYPES.values())
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Multimodal rotary (M-RoPE) fields of a vision-language config's rope parameters (Qwen3.5's text_config):
# the rotated dims split into time, height and width sections, each rotated by its own position. A text
# token's three positions are one and the same, so for text these fields do not change the rotation.
MROPE_FIELDS = ("mrope_section", "mrope_interleaved")
# YaRN: the rope of DeepSeek's checkpoints, checked against transformers for the MLA families only.
MLA_ROPE_TYPES = ("yarn",)


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something the bitwise path cannot do."""


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts part of a decoder (Qwen3-MoE; DeepSeek's with the routing fields below)."""

    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # of each expert (moe_intermediate_size)
    norm_topk_prob: bool  # renormalise the k routing weights to sum to 1
    sparse_layers: tuple[int, ...]  # layers with an MoE block; the others have the dense MLP
    scoring: str = "softmax"  # "softmax" (kernels.route) or "sigmoid" (DeepSeek-V3: kernels.route_grouped)
    n_group: int = 1  # sigmoid routing: expert groups, of which the best topk_group are kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # times the routing weights (after norm_topk_prob)
    correction_bias: bool = False  # the router holds an fp32 e_score_correction_bias (choice only)
    shared_intermediate_size: int = 0  # DeepSeek's shared experts, one SwiGLU MLP (0: none)

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok ({self.top_k}) must lie in [1, num_experts ({self.num_experts})]"
            )
        if self.intermediate_size < 1:
            raise UnsupportedModelError(f"moe_intermediate_size must be positive, got {self.intermediate_size}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"scoring_func {self.scoring!r} is not supported (softmax or sigmoid)")
        if self.scoring == "softmax" and (self.n_group, self.topk_group, self.correction_bias) != (1, 1, False):
            raise UnsupportedModelError("softmax routing takes no expert groups and no correction bias")
        if self.scoring == "sigmoid":
            from vexact_vllm.kernels.moe.routing import check_grouping

            try:
                check_grouping(self.num_experts, self.top_k, self.n_group, self.topk_group)
            except ValueError as e:
                raise UnsupportedModelError(f"{e}; the checkpoint's routing cannot be reproduced") from None
        if not self.routed_scaling_factor > 0:
            raise UnsupportedModelError(f"routed_scaling_factor must be positive, got {self.routed_scaling_factor}")


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention (MLA): the projections' sizes. The attention runs in the
    absorbed form over the latent: one key head of kv_lora_rank + qk_rope_head_dim shared by every
    query head, values of kv_lora_rank, then each head's v_head_dim up-projection (mla.py)."""

    q_lora_rank: int | None  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int  # the latent kv_a_proj_with_mqa compresses K and V to
    qk_nope_head_dim: int  # the per-head key/query part without rotation
    qk_rope_head_dim: int  # the rotated part (the key's is one head shared by all)
    v_head_dim: int
    rope_interleave: bool  # the rotated dims come in (even, odd) pairs, de-interleaved before the rotation
    attention_bias: bool = False  # biases on q_a_proj (or q_proj), kv_a_proj_with_mqa and o_proj

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise UnsupportedModelError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise UnsupportedModelError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): the linear-attention layers' sizes and which layers they are.
    The other layers are gated full attention (model_patches/gated_delta.py, hybrid.py)."""

    layers: tuple[int, ...]  # the Gated DeltaNet layers (layer_types "linear_attention")
    num_k_heads: int  # linear_num_key_heads
    num_v_heads: int  # linear_num_value_heads (a multiple of num_k_heads)
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim: the causal conv's width W

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            if getattr(self, name) < 1:
                raise UnsupportedModelError(f"linear-attention {name} must be positive, got {getattr(self, name)}")
        if self.num_v_heads % self.num_k_heads:
            raise UnsupportedModelError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of linear_num_key_heads "
                f"({self.num_k_heads})"
            )
        if self.conv_kernel < 2:
            raise UnsupportedModelError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}")

    @property
    def conv_dim(self) -> int:
        """C: the conv's channels, q | k | v = 2 HK DK + HV DV."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def shard(self, size: int) -> LinearAttentionConfig:
        """One rank's layers in a tensor-parallel group of `size`: HK / size key heads and the HV / size value
        heads that read them (model_patches/gated_delta.py); refused unless `size` divides HK."""
        if self.num_k_heads % size:
            raise UnsupportedModelError(
                f"--tensor-parallel-size {size} does not divide the {self.num_k_heads} linear-attention key heads "
                "(linear_num_key_heads); use a tensor-parallel size that divides it"
            )
        return replace(self, num_k_heads=self.num_k_heads // size, num_v_heads=self.num_v_heads // size)


@dataclass
class DecoderConfig:
    model_type: str  # a row of the family table (families.py): picks the model definition
    vocab_size: int  # rows of embed_tokens / lm_head, padding rows included
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    # Hugging Face rope parameters (rope_type plus its factors); None means plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama's and Qwen3's attention_bias also put a bias on o_proj (Qwen2's never)
    mlp_bias: bool = False  # Llama's mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    moe: MoeConfig | None = None  # the experts of an MoE family; None for dense families
    mla: MlaConfig | None = None  # DeepSeek's latent attention; head_dim is then its q/k head size
    softmax_scale: float | None = None  # the attention's scale; None: head_dim ** -0.5
    partial_rotary_factor: float = 1.0  # the rotated share of each head's dims (hybrid families: 0.25)
    linear: LinearAttentionConfig | None = None  # Gated DeltaNet layers of a hybrid family; None elsewhere
    extra: dict[str, Any] = field(default_factory=dict)  # informational only

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(_unsupported_type_message(self.model_type))
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        supported = SUPPORTED_ROPE_TYPES + (MLA_ROPE_TYPES if self.mla is not None else ())
        if rope_type not in supported:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported by vexact-vllm (supported: "
                f"{', '.join(supported)}); use a checkpoint without this RoPE scaling"
            )
        if self.mla is not None and self.head_dim != self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim:
            raise UnsupportedModelError("an MLA decoder's head_dim is qk_nope_head_dim + qk_rope_head_dim")
        if self.partial_rotary_factor != 1.0 and self.linear is None:
            raise UnsupportedModelError(
                f"partial_rotary_factor={self.partial_rotary_factor} is supported by vexact-vllm for the hybrid "
                "families (Qwen3-Next, Qwen3.5) only; use a checkpoint that rotates whole heads"
            )
        rotary = int(self.head_dim * self.partial_rotary_factor)
        if not 0 < rotary <= self.head_dim or rotary % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor={self.partial_rotary_factor} of head_dim {self.head_dim} rotates {rotary} "
                "dims; it must be an even number in (0, head_dim]"
            )

    @property
    def rotary_dim(self) -> int:
        """The dims each head's rotation covers: MLA's qk_rope_head_dim, else int(head_dim * partial_rotary_factor)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """The softmax scale both sides attend with."""
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5

    @property
    def architecture(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @classmethod
    def from_hf(cls, hf_config) -> DecoderConfig:
        """Read a transformers config of a supported family; the family file reads its own part
        (biases, q/k norm, experts: `decoder_fields`). A vision-language checkpoint's config (Qwen3.5's
        `Qwen3_5ForConditionalGeneration`) is read through its text config: the decoder is its language
        model, under the family of the checkpoint's model_type."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(_unsupported_type_message(model_type))
        if BY_MODEL_TYPE[model_type].text_config:
            hf_config = hf_config.get_text_config()
        _refuse_unsupported_features(hf_config)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope = _rope_parameters(hf_config)
        partial_rotary_factor = float(rope.pop("partial_rotary_factor", 1.0))
        mrope = {k: rope.pop(k) for k in MROPE_FIELDS if k in rope}
        if mrope and not BY_MODEL_TYPE[model_type].hybrid:
            raise UnsupportedModelError(
                f"multimodal rotary positions ({', '.join(mrope)} in the rope parameters) are supported by "
                "vexact-vllm for Qwen3.5's text model only; use a checkpoint without them"
            )
        fields = dict(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=getattr(hf_config, "intermediate_size", None) or 0,  # 0: no dense MLP (Qwen3.5-MoE)
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            partial_rotary_factor=partial_rotary_factor,
            extra=mrope,  # M-RoPE: text positions rotate as one position (hybrid.py)
        )
        fields.update(BY_MODEL_TYPE[model_type].load().decoder_fields(hf_config))  # a family may set head_dim
        return cls(**fields)


def _unsupported_type_message(model_type) -> str:
    return (
        f"model type {model_type!r} is not supported by vexact-vllm; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}. Serve it without --model-impl vexact "
        "(it will not be bitwise equal to the trainer)."
    )


def _rope_parameters(hf_config) -> dict[str, Any]:
    """transformers 5 keeps rope in `rope_parameters`; older configs in rope_theta/rope_scaling."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        rope = dict(params)
    else:
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    factor = getattr(hf_config, "partial_rotary_factor", None)
    if factor is not None:
        rope.setdefault("partial_rotary_factor", factor)
    return rope


def _refuse_unsupported_features(hf_config) -> None:
    quantization = getattr(hf_config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    if method == "fp8":
        raise UnsupportedModelError(
            "FP8 (block-quantized) checkpoints, such as DeepSeek-V3's official release, are not supported by "
            "vexact-vllm (the trainer computes in bf16): convert the checkpoint to bf16 first (DeepSeek's "
            "inference/fp8_cast_bf16.py, or VeOmni's scripts/deepseek_v3/fp8_cast_bf16.py) and serve that"
        )
    if quantization:
        raise UnsupportedModelError(
            "quantized checkpoints are not supported by vexact-vllm (the trainer computes in "
            "bf16/fp32); use the unquantized checkpoint"
        )
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise UnsupportedModelError(
            "sliding-window attention is not supported by vexact-vllm; set use_sliding_window=false"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(
            f"dtype {dtype} is not supported by vexact-vllm; use bfloat16 or float32 "
            "(for example --dtype bfloat16)"
        )
    return dtype
