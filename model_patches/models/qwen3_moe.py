"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm, explicit
head_dim, q/k/v/o biases with `attention_bias`) and, on its sparse layers, the mixture-of-experts
block of `model_patches.moe` (softmax router, top-k experts per token, `norm_topk_prob`); the other
layers keep Qwen3's dense SwiGLU MLP (`intermediate_size`). Layer i is sparse, as in Hugging Face's
Qwen3MoeDecoderLayer, when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0.

Refused, naming the field: router or expert options the block cannot reproduce (shared experts,
grouped top-k, another scoring function, a routed scaling factor). `output_router_logits` and
`router_aux_loss_coef` only matter to the trainer's loss, never to the log-probs.
"""

from __future__ import annotations

from ..config import DecoderConfig, MoeConfig, UnsupportedModelError
from ..layers import MLP, Decoder
from ..moe import SparseMoeBlock, check_expert_tensors

# Fields of other MoE routers: present and active, they would change the routing we compute.
_REFUSED = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "n_group": "grouped top-k",
    "topk_group": "grouped top-k",
    "topk_method": "another top-k method",
    "scoring_func": "another router scoring function",
    "routed_scaling_factor": "a routed scaling factor",
}
# Values of those fields that change nothing (absent, zero and False do not either).
_NEUTRAL = {"scoring_func": "softmax", "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1,
            "topk_group": 1}  # fmt: skip


def _refuse_router_options(hf_config) -> None:
    for name, what in _REFUSED.items():
        value = getattr(hf_config, name, None)
        if not value or value == _NEUTRAL.get(name):
            continue
        raise UnsupportedModelError(
            f"{name}={value!r} ({what}) is not supported by vexact-vllm's Qwen3-MoE: its rollouts could "
            "not be kept bitwise equal to the trainer. Use a plain Qwen3-MoE config (softmax top-k router)."
        )


def sparse_layers(hf_config) -> tuple[int, ...]:
    """Hugging Face's rule for which layers get the MoE block."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    if hf_config.num_experts <= 0:
        return ()
    return tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def decoder_fields(hf_config) -> dict:
    """What a Qwen3-MoE config adds to the shared DecoderConfig."""
    _refuse_router_options(hf_config)
    bias = bool(getattr(hf_config, "attention_bias", False))
    moe = MoeConfig(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        sparse_layers=sparse_layers(hf_config),
    )
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True, moe=moe)


class Qwen3MoeDecoder(Decoder):
    def mlp(self, config: DecoderConfig, layer_idx: int):
        if layer_idx in config.moe.sparse_layers:
            return SparseMoeBlock(config, self.tp)
        return MLP(config, self.tp)


# engine_checks.py looks the checkpoint check up by this name: every expert's tensors on every sparse layer.
check_checkpoint = check_expert_tensors
