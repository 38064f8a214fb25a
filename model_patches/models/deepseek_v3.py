"""DeepSeek-V3 and DeepSeek-V2 (`DeepseekV3ForCausalLM`: DeepSeek-V3/R1, Moonlight, Kimi-K2-shaped models;
`DeepseekV2ForCausalLM`: DeepSeek-V2-Lite): one decoder, the two architectures differ in config only.

Each layer: pre-norm `MlaAttention` (model_patches/mla.py: q through q_proj, or the q LoRA q_a_proj ->
q_a_layernorm -> q_b_proj; the latent kv_a_proj_with_mqa -> kv_a_layernorm, attended in the absorbed
form: kv_b_proj's key rows folded into each head's query, its value rows applied to the attended latent;
RoPE on the rotary dims, YaRN's mscale^2 in the softmax scale), then the dense
SwiGLU MLP on layers below `first_k_dense_replace` and, above, `moe.SharedExpertsMoeBlock`: routed
experts plus `n_shared_experts` shared ones (one MLP of n_shared_experts * moe_intermediate_size),
added once after the routed sum. Routing:
- V3: sigmoid scores, the fp32 `e_score_correction_bias` added for the choice only, the best
  `topk_group` of `n_group` groups, top-k, unbiased weights, `norm_topk_prob`, x `routed_scaling_factor`
  (kernels.route_grouped);
- V2: softmax, `topk_method="greedy"`, x `routed_scaling_factor` (kernels.route, no normalisation, as
  transformers' DeepseekV2TopkRouter, which ignores `norm_topk_prob`).
The rotary dims: V3 interleaved pairs when `rope_interleave` (its default), V2 always (its complex
rotation rotates adjacent pairs).

Refused, naming the field: V2's `topk_method="group_limited_greedy"` (and any other), another
`scoring_func` than the architecture's, V2's `norm_topk_prob=true` (transformers ignores it, DeepSeek's
own code does not: ambiguous), `moe_layer_freq` != 1 (transformers ignores it, DeepSeek's code does
not), a V3 sparse-attention indexer (`index_topk`, V3.2), FP8 checkpoints (convert to bf16: config.py
and `check_checkpoint`). Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`, DeepSeek-V3's
`num_nextn_predict_layers`) are not part of the model: the vLLM loader skips them (vllm_wrapper.py)
and transformers' loader reports them as unused.

Differences from transformers' DeepseekV3/V2 modeling (5.x), each a rounding, none a change of math:
1. Norms: one rounding (fp32 normalised value times the fp32 weight, cast once) where transformers
   casts the normalised value to bf16 and multiplies by the weight in bf16 (every family here).
2. Rotary: cos/sin in fp32 from float64 frequencies with YaRN's attention factor folded in, the
   rotation in fp32 and rounded once; V3's transformers code casts cos/sin to bf16 and rotates in bf16,
   V2's rotates in fp32 as complex numbers. The de-interleaved layout (even dims, then odd) is V3's;
   V2 keeps its pairs interleaved, which only reorders the terms of the q.k sum.
3. Attention: the absorbed form (mla.py) with the position-anchored kernel (kernels.attention) over the
   latent and the rotary key, one key head for all query heads, fp32 softmax, where transformers
   re-expands its latent cache to per-head K and V every call and uses sdpa/eager.
4. Router: fp32 logits from the batch-invariant GEMM over bf16 inputs (transformers casts x and the
   weight to fp32: the same products, another summation order); sigmoid as 1 / (1 + exp(-z)); stable
   sorts for the group and expert choices (ties to the lower index; torch.topk leaves ties open);
   the k-term normalising sum in slot order. V2's softmax as exp(log_softmax) (kernels.moe.routing).
5. Experts: every expert's SwiGLU and the k weighted outputs summed in fp32 in slot order and rounded
   once (kernels.fused_moe), where transformers rounds each expert's output times its weight to bf16
   and index_adds them in expert order. The shared experts' output is added in the model dtype in
   transformers' order (routed + shared).
6. The lm_head: fp32 logits (every family).
"""

from __future__ import annotations

from vexact_vllm.kernels.norms.rope import yarn_mscale

from ..config import DecoderConfig, MlaConfig, MoeConfig, UnsupportedModelError
from ..layers import MLP, Decoder
from ..mla import MlaAttention
from ..moe import SharedExpertsMoeBlock, check_expert_tensors

# Per architecture: the routing fields' only supported values (None: absent is fine too).
_ROUTING = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
    "deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy"},
}


def _refuse(name: str, value, why: str) -> None:
    raise UnsupportedModelError(
        f"{name}={value!r} is not supported by vexact-vllm's DeepSeek family: {why}. Use a checkpoint "
        "whose config.json has the published DeepSeek-V3/V2 routing, or serve it without --model-impl vexact"
    )


def _check_options(hf_config) -> None:
    model_type = hf_config.model_type
    for name, supported in _ROUTING[model_type].items():
        value = getattr(hf_config, name, None)
        if value is not None and value != supported:
            _refuse(name, value, f"{model_type} routes with {name}={supported!r} only")
    if model_type == "deepseek_v2" and getattr(hf_config, "norm_topk_prob", False):
        _refuse("norm_topk_prob", True, "transformers' DeepSeek-V2 ignores it and DeepSeek's code applies it")
    freq = getattr(hf_config, "moe_layer_freq", 1)
    if freq not in (None, 1):
        _refuse("moe_layer_freq", freq, "transformers puts an MoE block on every layer from first_k_dense_replace")
    if getattr(hf_config, "index_topk", None):
        _refuse("index_topk", hf_config.index_topk, "DeepSeek-V3.2's sparse attention indexer is not supported")
    if not getattr(hf_config, "n_routed_experts", None):
        _refuse("n_routed_experts", getattr(hf_config, "n_routed_experts", None), "the MoE layers need experts")


def softmax_scale(hf_config) -> float:
    """transformers' `yarn_apply_mscale`: (qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2
    for a scaled rope whose `mscale_all_dim` is set."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim", 0):
        mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def sparse_layers(hf_config) -> tuple[int, ...]:
    """transformers' rule: an MoE block on every layer from `first_k_dense_replace` on."""
    first = getattr(hf_config, "first_k_dense_replace", 0) or 0
    return tuple(range(first, hf_config.num_hidden_layers))


def decoder_fields(hf_config) -> dict:
    """What a DeepSeek-V3/V2 config adds to the shared DecoderConfig (head_dim: the q/k head size)."""
    _check_options(hf_config)
    v3 = hf_config.model_type == "deepseek_v3"
    mla = MlaConfig(
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        rope_interleave=bool(getattr(hf_config, "rope_interleave", True)) if v3 else True,
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
    )
    moe = MoeConfig(
        num_experts=hf_config.n_routed_experts,
        top_k=hf_config.num_experts_per_tok,
        intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(hf_config.norm_topk_prob) if v3 else False,
        sparse_layers=sparse_layers(hf_config),
        scoring="sigmoid" if v3 else "softmax",
        n_group=(hf_config.n_group or 1) if v3 else 1,
        topk_group=(hf_config.topk_group or 1) if v3 else 1,
        routed_scaling_factor=float(hf_config.routed_scaling_factor),
        correction_bias=v3,
        shared_intermediate_size=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0),
    )
    return dict(
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        num_kv_heads=hf_config.num_attention_heads,  # the decoder's field; MlaAttention attends one latent head
        qkv_bias=False,
        o_bias=False,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=False,
        moe=moe,
        mla=mla,
        softmax_scale=softmax_scale(hf_config),
    )


class DeepseekV3Decoder(Decoder):
    def attention(self, config: DecoderConfig, layer_idx: int):
        return MlaAttention(config, layer_idx, self.tp)

    def mlp(self, config: DecoderConfig, layer_idx: int):
        if layer_idx in config.moe.sparse_layers:
            return SharedExpertsMoeBlock(config, self.tp)
        return MLP(config, self.tp)


def check_checkpoint(names: set[str], config: DecoderConfig) -> None:
    """Every expert's tensors on every sparse layer; an FP8 checkpoint (its `weight_scale_inv` tensors)
    refused with what to do."""
    scales = sorted(n for n in names if n.endswith("weight_scale_inv"))
    if scales:
        raise UnsupportedModelError(
            f"the checkpoint holds FP8 block scales ({scales[0]}, ...): FP8 checkpoints are not supported by "
            "vexact-vllm; convert it to bf16 first (DeepSeek's inference/fp8_cast_bf16.py, or VeOmni's "
            "scripts/deepseek_v3/fp8_cast_bf16.py)"
        )
    check_expert_tensors(names, config)
