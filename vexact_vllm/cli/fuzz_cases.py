"""Random cases for `vexact-vllm fuzz`: a checkpoint, prompts, sampling options, engine settings.

A case is a pure function of (seed, index, profile, limits): `draw_case` uses only its own
`random.Random`, so `vexact-vllm fuzz --seed S --case I` rebuilds exactly the case that failed.

What varies (each within what the kernels and the families support):
- the family (every text row of the family table: Qwen3, Qwen2, Llama, Qwen3-MoE, DeepSeek-V3 and V2: their MLA sizes,
  q LoRA, routing, shared experts, dense first layers, YaRN; the Gated DeltaNet hybrids Qwen3-Next, Qwen3.5 and
  Qwen3.5-MoE: the linear-attention key and value heads (value heads a multiple of key heads) and head dims, the layer
  pattern (1-3 Gated DeltaNet layers per full-attention layer, either kind last), the conv width (2-4), the partial
  rotary factor, Qwen3.5's M-RoPE sections or none, experts with a gated shared expert) and its options: hidden size, layers, head_dim (32, 64, 128, and
  256 on CUDA), query heads and the GQA ratio, experts (2-16), experts per token and dense layers, intermediate size, vocabulary larger than the
  tokenizer by a random amount, tied or untied embeddings, q/k/v, o and MLP biases where the family
  has them, RoPE theta and scaling (default, linear, llama3), weight scale;
- prompts: random token ids, lengths from 1 to `max_prompt_len` (log-uniform: short and long);
- per request: temperature (greedy, below vLLM's 0.01 floor, and several others mixed in one batch),
  top-k, top-p, min-p, output length;
- the engine: KV block size, max_num_seqs, a token budget that forces chunked prefill, prefix
  caching on or off, CUDA graphs or eager, async scheduling (CUDA); a hybrid's engine keeps the values
  option_policy.HYBRID_ENGINE gives (no prefix caching), as vexact refuses others;
- the compositions (see rollout.py): batch and shuffled always, prefix-cache when caching is on,
  alone for small batches, and a random subset of the ones that need their own engine.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

from vexact_vllm.model_patches.families import BY_MODEL_TYPE
from vexact_vllm.model_patches.families import FAMILIES as FAMILY_TABLE
from vexact_vllm.option_policy import HYBRID_ENGINE
from vexact_vllm.tiny_model import TOKENIZER_VOCAB_SIZE

# Size limits per profile: CPU cases must run in CI in seconds, CUDA cases may be larger.
# hybrid_layers: a hybrid's layers (at least one Gated DeltaNet and one full-attention layer);
# linear_head_dims: its Gated DeltaNet key and value head dims (multiples of 8; the kernels pad to powers of 2).
PROFILES = {
    "cpu": dict(layers=(1, 2), hidden=(64, 96, 128, 192), head_dims=(16, 32, 64), max_heads=8,
                prompts=(2, 6), max_tokens=(1, 12), block_sizes=(16, 32, 64),
                hybrid_layers=(2, 4), linear_head_dims=(8, 16, 24, 32)),
    "cuda": dict(layers=(1, 4), hidden=(128, 256, 384, 512, 1024), head_dims=(32, 64, 64, 128, 128, 256),
                 max_heads=16, prompts=(3, 24), max_tokens=(1, 48), block_sizes=(16, 32, 64, 128),
                 hybrid_layers=(2, 8), linear_head_dims=(32, 64, 96, 128, 128)),
}  # fmt: skip
# Every text row of the family table; a vision-language row (Qwen3.5's) is drawn as its language model's row.
FAMILIES = tuple(f.model_type for f in FAMILY_TABLE if not f.text_config)
HYBRIDS = frozenset(f for f in FAMILIES if BY_MODEL_TYPE[f].hybrid)  # Gated DeltaNet: Qwen3-Next, Qwen3.5
TEMPERATURES = (0.0, 0.005, 0.3, 0.7, 1.0, 1.3)
SHARED = ("batch", "shuffled", "prefix-cache", "alone")
FRESH = {"cpu": ("chunked-prefill", "preemption"), "cuda": ("chunked-prefill", "preemption", "eager")}


@dataclass
class FuzzCase:
    seed: int
    index: int
    profile: str
    model_type: str
    fields: dict  # Hugging Face config fields
    weight_std: float
    prompt_lens: list[int]
    per_request: list[dict]  # RolloutSettings.per_request
    engine: dict  # extra LLM(...) arguments
    block_size: int
    chunk_tokens: int  # the chunked-prefill composition's token budget
    compositions: list[str]
    prefix_len: int  # tokens of the prefix-cache composition's shared prefix
    tokenizer_len: int = 0  # filled once the checkpoint exists (prompt ids are drawn below it)
    notes: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"case {self.index} (seed {self.seed})"

    def model_summary(self) -> dict:
        """The checkpoint: family and sizes (and the MoE's experts, the biases, RoPE)."""
        f = self.fields
        out = {
            "family": self.model_type, "hidden": f["hidden_size"], "layers": f["num_hidden_layers"],
            "heads": f["num_attention_heads"], "kv_heads": f["num_key_value_heads"],
            "head_dim": f.get("head_dim") or f["hidden_size"] // f["num_attention_heads"],
            "intermediate": f.get("intermediate_size"), "vocab": f["vocab_size"], "tied": f["tie_word_embeddings"],
            "rope": f["rope_parameters"]["rope_type"], "weight_std": self.weight_std,
        }  # fmt: skip
        if "num_experts" in f:
            out.update(experts=f["num_experts"], experts_per_token=f["num_experts_per_tok"],
                       moe_intermediate=f["moe_intermediate_size"], dense_layers=len(f.get("mlp_only_layers", [])),
                       shared_intermediate=f.get("shared_expert_intermediate_size"))  # fmt: skip
        if self.model_type in HYBRIDS:
            kinds = {"linear_attention": "L", "full_attention": "F"}
            out.update(linear_heads=f"{f['linear_num_key_heads']}/{f['linear_num_value_heads']}",
                       linear_head_dims=f"{f['linear_key_head_dim']}/{f['linear_value_head_dim']}",
                       conv=f["linear_conv_kernel_dim"], rotary=partial_rotary_factor(f),
                       mrope="mrope_section" in f["rope_parameters"],
                       layer_pattern="".join(kinds[t] for t in layer_types(f)))  # fmt: skip
        out["biases"] = [name for name in ("attention_bias", "mlp_bias") if f.get(name)]
        return out

    def engine_summary(self) -> dict:
        """The engine settings; None where the case leaves vLLM's default."""
        e = self.engine
        return {
            "block_size": self.block_size, "max_num_seqs": e["max_num_seqs"],
            "token_budget": e.get("max_num_batched_tokens"), "prefix_caching": e["enable_prefix_caching"],
            "cuda_graphs": None if "enforce_eager" not in e else not e["enforce_eager"],
            "async_scheduling": e.get("async_scheduling"), "chunked_prefill_budget": self.chunk_tokens,
        }  # fmt: skip

    def describe_parts(self) -> dict[str, str]:
        """The checkpoint ("model"), the requests and the engine settings the case ran, as text."""
        m, e = self.model_summary(), self.engine_summary()
        moe = ""
        if "experts" in m:
            moe = f", {m['experts']} experts top-{m['experts_per_token']} of {m['moe_intermediate']}"
            moe += f" + shared {m['shared_intermediate']}" if m["shared_intermediate"] else ""
            moe += f" ({m['dense_layers']} dense layers)" if m["dense_layers"] else ""
        layers = f"{m['layers']} layer{'s' if m['layers'] != 1 else ''}"
        if "layer_pattern" in m:  # L: Gated DeltaNet, F: full attention
            layers += (f" {m['layer_pattern']}, Gated DeltaNet heads {m['linear_heads']} x {m['linear_head_dims']} "
                       f"conv {m['conv']}")  # fmt: skip
        intermediate = f", intermediate {m['intermediate']}" if m["intermediate"] else ""
        rotary = f" (rotary {m['rotary']:g}{', M-RoPE sections' if m['mrope'] else ''})" if "rotary" in m else ""
        model = (f"{m['family']}, hidden {m['hidden']}, {layers}, heads {m['heads']}/{m['kv_heads']} x "
                 f"{m['head_dim']}{intermediate}{moe}, vocab {m['vocab']} "
                 f"{'tied' if m['tied'] else 'untied'}, rope {m['rope']}{rotary}"
                 f"{''.join(f', {b}' for b in m['biases'])}")  # fmt: skip
        temps = sorted({o["temperature"] for o in self.per_request})
        truncation = sorted({k for o in self.per_request for k in ("top_k", "top_p", "min_p") if k in o})
        requests = (f"{len(self.prompt_lens)} prompts of {min(self.prompt_lens)}-{max(self.prompt_lens)} tokens, "
                    f"temperature {'/'.join(f'{t:g}' for t in temps)}"
                    f"{', ' + '/'.join(truncation) if truncation else ''}")  # fmt: skip

        def default(value, shown):
            return "vLLM's default" if value is None else shown

        graphs = "n/a (CPU)" if self.profile == "cpu" else default(e["cuda_graphs"], "on" if e["cuda_graphs"] else "off (eager)")
        engine = (f"block {e['block_size']}, max_num_seqs {e['max_num_seqs']}, token budget "
                  f"{default(e['token_budget'], e['token_budget'])}, prefix caching {'on' if e['prefix_caching'] else 'off'}, "
                  f"CUDA graphs {graphs}, async scheduling "
                  f"{default(e['async_scheduling'], 'on' if e['async_scheduling'] else 'off')}")  # fmt: skip
        return {"model": model, "requests": requests, "engine": engine}

    def describe(self) -> str:
        """One line: `describe_parts`."""
        return "; ".join(f"{k}: {v}" for k, v in self.describe_parts().items())

    def to_dict(self) -> dict:
        return asdict(self)


def layer_types(fields: dict) -> list[str]:
    """A hybrid's layer kinds: its `layer_types`, or transformers' rule for `full_attention_interval` n
    (layer i is full attention when (i + 1) % n == 0, Gated DeltaNet otherwise)."""
    if "layer_types" in fields:
        return list(fields["layer_types"])
    n = fields["full_attention_interval"]
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(fields["num_hidden_layers"])]


def partial_rotary_factor(fields: dict) -> float:
    """The rotated share of a hybrid's attention head dims: in the rope parameters or, as Qwen3-Next's
    config.json has it, beside them (transformers reads the first, then the second)."""
    return fields["rope_parameters"].get("partial_rotary_factor", fields.get("partial_rotary_factor"))


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def _model_fields(rng: random.Random, family: str, limits: dict) -> dict:
    head_dim = rng.choice(limits["head_dims"])
    kv_heads = rng.choice((1, 1, 2, 4))
    heads = kv_heads * rng.choice([g for g in (1, 2, 3, 4, 8) if kv_heads * g <= limits["max_heads"]])
    # Qwen2 has no head_dim field (hidden / heads); Llama's and DeepSeek-V2's configs require hidden % heads == 0.
    choices = [h for h in limits["hidden"] if family not in ("llama", "deepseek_v2") or h % heads == 0]
    hidden = heads * head_dim if family == "qwen2" or not choices else rng.choice(choices)
    fields = dict(
        hidden_size=hidden,
        intermediate_size=32 * rng.randint(max(1, hidden // 32), 4 * max(1, hidden // 32)),
        num_hidden_layers=rng.randint(*limits["layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=TOKENIZER_VOCAB_SIZE + rng.choice((0, 1, 64, 333)),  # rows past the tokenizer: padding
        tie_word_embeddings=rng.random() < 0.5,
        max_position_embeddings=32768,
        rms_norm_eps=rng.choice((1e-6, 1e-5)),
        architectures=[BY_MODEL_TYPE[family].architecture],
    )
    if family != "qwen2":
        fields["head_dim"] = head_dim
    theta = rng.choice((10000.0, 500000.0, 1000000.0))
    rope = rng.choice(("default", "default", "linear", "llama3"))
    if rope == "linear":
        fields["rope_parameters"] = {"rope_type": "linear", "rope_theta": theta, "factor": rng.choice((2.0, 4.0))}
    elif rope == "llama3":
        fields["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}  # fmt: skip
    else:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if family == "llama":
        fields["attention_bias"] = rng.random() < 0.3
        fields["mlp_bias"] = rng.random() < 0.3
    elif family in ("qwen3", "qwen3_moe") or family in HYBRIDS:
        fields["attention_bias"] = rng.random() < 0.2
    if family.startswith("deepseek"):
        fields.update(_deepseek_fields(rng, family, hidden), num_key_value_heads=heads)  # K and V per head
    if family == "qwen3_moe":
        experts = rng.choice((2, 4, 8, 16))
        fields.update(
            num_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
            moe_intermediate_size=32 * rng.randint(1, max(1, hidden // 32)), norm_topk_prob=rng.random() < 0.7,
            decoder_sparse_step=rng.choice((1, 1, 2)),
            mlp_only_layers=[i for i in range(fields["num_hidden_layers"]) if rng.random() < 0.25],
        )  # fmt: skip
    if family in HYBRIDS:
        fields.update(_hybrid_fields(rng, family, fields, limits))
        if family == "qwen3_5_moe_text":  # an MoE block on every layer, no dense MLP
            del fields["intermediate_size"]
    return fields


def _hybrid_fields(rng: random.Random, family: str, fields: dict, limits: dict) -> dict:
    """Qwen3-Next / Qwen3.5: the Gated DeltaNet heads (value heads a multiple of key heads) and head dims,
    the conv width, the layer pattern (`per_full` Gated DeltaNet layers per full-attention layer, as
    `full_attention_interval` or as `layer_types` starting anywhere in the pattern; either kind last, one
    of each at least), the partial rotary factor; the experts and the gated shared expert of the MoE
    variants (Qwen3-Next's dense layers through mlp_only_layers and decoder_sparse_step)."""
    hidden, head_dim = fields["hidden_size"], fields["head_dim"]
    k_heads = rng.choice((1, 2, 4))
    v_heads = k_heads * rng.choice([r for r in (1, 2, 3, 4) if k_heads * r <= limits["max_heads"]])
    layers = rng.randint(*limits["hybrid_layers"])
    out = dict(
        num_hidden_layers=layers, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=rng.choice(limits["linear_head_dims"]),
        linear_value_head_dim=rng.choice(limits["linear_head_dims"]), linear_conv_kernel_dim=rng.randint(2, 4),
    )  # fmt: skip
    per_full = rng.randint(1, 3)
    if layers > per_full and rng.random() < 0.5:
        out["full_attention_interval"] = per_full + 1
    else:
        pattern = ["linear_attention"] * per_full + ["full_attention"]
        start = rng.randrange(len(pattern))
        kinds = [pattern[(start + i) % len(pattern)] for i in range(layers)]
        if "full_attention" not in kinds:  # fewer layers than the pattern: end on full attention
            kinds[-1] = "full_attention"
        out["layer_types"] = kinds
    factor = rng.choice([f for f in (0.25, 0.5, 1.0) if int(head_dim * f) > 0 and int(head_dim * f) % 2 == 0])
    rope = dict(fields["rope_parameters"])
    if rng.random() < 0.5:
        rope["partial_rotary_factor"] = factor
    else:
        out["partial_rotary_factor"] = factor
    half = int(head_dim * factor) // 2
    if family.startswith("qwen3_5") and rope["rope_type"] == "default" and half >= 3 and rng.random() < 0.4:
        # Qwen3.5's published configs: M-RoPE sections over the rotated pairs (a text token rotates as one position)
        t = rng.randint(1, half - 2)
        h = rng.randint(1, half - 1 - t)
        rope.update(mrope_section=[t, h, half - t - h], mrope_interleaved=rng.random() < 0.7)
    out["rope_parameters"] = rope
    if family in ("qwen3_next", "qwen3_5_moe_text"):
        experts = rng.choice((2, 4, 8, 16))
        out.update(num_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
                   moe_intermediate_size=32 * rng.randint(1, max(1, hidden // 32)),
                   shared_expert_intermediate_size=32 * rng.randint(1, max(1, hidden // 32)))  # fmt: skip
    if family == "qwen3_next":
        out.update(norm_topk_prob=rng.random() < 0.7, decoder_sparse_step=rng.choice((1, 1, 2)),
                   mlp_only_layers=[i for i in range(layers) if rng.random() < 0.25])  # fmt: skip
    return out


def _deepseek_fields(rng: random.Random, family: str, hidden: int) -> dict:
    """MLA sizes (q/k and v head sizes multiples of 8, that need not match), q LoRA or not, the routing
    (V3: sigmoid with groups and a correction bias; V2: softmax greedy), shared experts, dense first
    layers, YaRN or not."""
    experts = rng.choice((4, 8, 16))
    top_k = rng.randint(1, min(4, experts))
    fields = dict(
        kv_lora_rank=rng.choice((32, 64, 96)), q_lora_rank=rng.choice((None, 32, 64)),
        qk_nope_head_dim=rng.choice((8, 16, 32)), qk_rope_head_dim=rng.choice((8, 16)), v_head_dim=rng.choice((8, 16, 24)),
        n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32 * rng.randint(1, max(1, hidden // 32)),
        n_shared_experts=rng.choice((1, 2)), first_k_dense_replace=rng.choice((0, 1)),
        routed_scaling_factor=rng.choice((1.0, 2.5)),
    )  # fmt: skip
    if family == "deepseek_v3":
        groups = [g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2]
        n_group = rng.choice(groups)
        topk_group = rng.choice([t for t in range(1, n_group + 1) if t * (experts // n_group) >= top_k])
        fields.update(n_group=n_group, topk_group=topk_group, norm_topk_prob=rng.random() < 0.8,
                      rope_interleave=rng.random() < 0.8, topk_method="noaux_tc", scoring_func="sigmoid")  # fmt: skip
    else:
        fields.update(topk_method="greedy", scoring_func="softmax", norm_topk_prob=False)
    if rng.random() < 0.5:
        mscale = rng.choice((1.0, 0.707))
        fields["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                                     "beta_slow": 1, "original_max_position_embeddings": 8192, "mscale": mscale,
                                     "mscale_all_dim": mscale}  # fmt: skip
    return fields


def _request_options(rng: random.Random, limits: dict) -> dict:
    options = {"temperature": rng.choice(TEMPERATURES), "max_tokens": rng.randint(*limits["max_tokens"])}
    if options["temperature"] > 0:
        if rng.random() < 0.3:
            options["top_k"] = rng.choice((1, 2, 5, 20, 100))
        if rng.random() < 0.3:
            options["top_p"] = rng.choice((0.5, 0.8, 0.95))
        if rng.random() < 0.15:
            options["min_p"] = rng.choice((0.05, 0.2))
    return options


def _engine(rng: random.Random, profile: str, hybrid: bool) -> dict:
    engine = {"enable_prefix_caching": rng.random() < 0.8, "max_num_seqs": rng.choice((2, 3, 8, 256))}
    if hybrid:  # the only values vexact serves a Gated DeltaNet model with
        engine.update({option: value for option, (value, _) in HYBRID_ENGINE.items()})
    if rng.random() < 0.4:  # a token budget below the prompts: chunked prefill in every composition
        engine["enable_chunked_prefill"] = True
        engine["max_num_batched_tokens"] = max(engine["max_num_seqs"], rng.choice((16, 48, 128, 512)))
    if profile == "cuda":
        engine["enforce_eager"] = rng.random() < 0.25
        engine["async_scheduling"] = rng.random() < 0.5
    return engine


def draw_case(seed: int, index: int, profile: str, max_prompt_len: int) -> FuzzCase:
    """The case `index` of the run `seed` (see the module docstring)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown fuzz profile {profile!r}; choose from {', '.join(PROFILES)}")
    rng = random.Random(f"vexact-fuzz/{seed}/{index}/{profile}/{max_prompt_len}")
    limits = PROFILES[profile]
    family = rng.choice(FAMILIES)
    n_prompts = rng.randint(*limits["prompts"])
    engine = _engine(rng, profile, family in HYBRIDS)
    block_size = rng.choice(limits["block_sizes"])
    compositions = ["batch", "shuffled"]
    if engine["enable_prefix_caching"]:
        compositions.append("prefix-cache")
    if n_prompts <= 6 and rng.random() < 0.5:
        compositions.insert(0, "alone")
    compositions += [c for c in FRESH[profile] if rng.random() < 0.5]
    return FuzzCase(
        seed=seed,
        index=index,
        profile=profile,
        model_type=family,
        fields=_model_fields(rng, family, limits),
        weight_std=rng.choice((0.02, 0.05, 0.1)),
        prompt_lens=[_log_uniform_int(rng, 1, max_prompt_len) for _ in range(n_prompts)],
        per_request=[_request_options(rng, limits) for _ in range(n_prompts)],
        engine=engine,
        block_size=block_size,
        chunk_tokens=rng.choice((16, 32, 64)),
        compositions=compositions,
        prefix_len=4 * block_size + block_size // 2 + rng.randint(0, block_size),
    )


def prompt_ids(case: FuzzCase) -> tuple[list[list[int]], list[int]]:
    """(prompts, shared prefix): random token ids below the tokenizer's size, from the case alone."""
    if case.tokenizer_len <= 0:
        raise ValueError("the case's checkpoint is not built yet (tokenizer_len unknown)")
    rng = random.Random(f"vexact-fuzz-prompts/{case.seed}/{case.index}")
    draw = lambda n: [rng.randrange(case.tokenizer_len) for _ in range(n)]  # noqa: E731
    return [draw(n) for n in case.prompt_lens], draw(case.prefix_len)
