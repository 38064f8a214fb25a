"""DecoderConfig.from_hf reads the three supported families and refuses what it cannot reproduce."""

import pytest
import torch
from transformers import AutoConfig, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from vexact_vllm.model_patches.config import (
    SUPPORTED_ARCHITECTURES,
    DecoderConfig,
    UnsupportedModelError,
    check_dtype,
)

# Tiny checkpoint shapes (vexact_vllm.tiny_model): 4 layers, hidden 128, 4 heads, 2 kv heads, vocab 448.
COMMON = dict(vocab_size=448, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
              num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
EXPECTED = {
    "qwen3": dict(rope_scaling=None, tie_word_embeddings=True, qkv_bias=False, o_bias=False, qk_norm=True),
    "qwen2": dict(rope_scaling=None, tie_word_embeddings=True, qkv_bias=True, o_bias=False, qk_norm=False),
    "llama": dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                  qk_norm=False),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_from_hf_tiny_checkpoints(tiny_paths, arch):
    cfg = DecoderConfig.from_hf(AutoConfig.from_pretrained(tiny_paths[arch]))
    assert cfg.model_type == arch
    assert cfg.architecture == ARCHITECTURES[arch]
    for name, value in {**COMMON, **EXPECTED[arch]}.items():
        assert getattr(cfg, name) == value, name
    assert cfg.mlp_bias is False


def test_from_hf_optional_biases_and_rope():
    llama = DecoderConfig.from_hf(LlamaConfig(attention_bias=True, mlp_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    qwen3 = DecoderConfig.from_hf(Qwen3Config(attention_bias=True))
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (True, True, True)  # as HF's Qwen3Attention
    # head_dim defaults to hidden // heads when the config has none
    assert DecoderConfig.from_hf(LlamaConfig(hidden_size=256, num_attention_heads=8)).head_dim == 32
    linear = DecoderConfig.from_hf(LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 5e5}))
    assert linear.rope_theta == 5e5 and linear.rope_scaling["rope_type"] == "linear"
    assert linear.rope_scaling["factor"] == 2.0
    legacy = DecoderConfig.from_hf(LlamaConfig(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5))
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling["rope_type"] == "linear"


def _sliding_layer_types():
    return Qwen3Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                       sliding_window=64)


REFUSALS = {
    "model_type": (lambda: GPT2Config(), ["'gpt2'", "not supported", *SUPPORTED_ARCHITECTURES]),
    "quantization": (lambda: Qwen3Config(quantization_config={"quant_method": "fp8"}), ["quantized"]),
    "sliding_window_qwen2": (lambda: Qwen2Config(use_sliding_window=True, sliding_window=64),
                             ["sliding-window", "use_sliding_window=false"]),
    "sliding_window_qwen3": (lambda: Qwen3Config(use_sliding_window=True, sliding_window=64, max_window_layers=0),
                             ["sliding-window"]),
    "sliding_layer_types": (_sliding_layer_types, ["sliding-window"]),
    "rope_yarn": (lambda: Qwen3Config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                       "original_max_position_embeddings": 8192}),
                  ["rope_type 'yarn'", "not supported"]),
    "rope_dynamic": (lambda: LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                          "rope_theta": 1e4}),
                     ["rope_type 'dynamic'", "not supported"]),
    "partial_rotary": (lambda: LlamaConfig(partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    "partial_rotary_in_rope": (lambda: LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                    "partial_rotary_factor": 0.5}),
                               ["partial_rotary_factor"]),
    "act_gelu": (lambda: LlamaConfig(hidden_act="gelu"), ["hidden_act 'gelu'", "silu"]),
    "act_gelu_tanh": (lambda: Qwen2Config(hidden_act="gelu_pytorch_tanh"), ["gelu_pytorch_tanh"]),
    "kv_heads": (lambda: LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=4),
                 ["num_attention_heads (6)", "num_key_value_heads (4)"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_from_hf_refuses(case):
    make, fragments = REFUSALS[case]
    with pytest.raises(UnsupportedModelError) as info:
        DecoderConfig.from_hf(make())
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_from_hf_refuses_attributes_set_after_construction():
    cfg = Qwen3Config()
    cfg.quantization_config = {"quant_method": "awq"}
    with pytest.raises(UnsupportedModelError, match="quantized"):
        DecoderConfig.from_hf(cfg)
    cfg = LlamaConfig()
    cfg.hidden_act = "relu"
    with pytest.raises(UnsupportedModelError, match="'relu'"):
        DecoderConfig.from_hf(cfg)
    cfg = Qwen3Config()
    cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="'longrope'"):
        DecoderConfig.from_hf(cfg)


def test_unsupported_model_error_is_value_error():
    assert issubclass(UnsupportedModelError, ValueError)


def test_direct_construction_refuses_unsupported():
    with pytest.raises(UnsupportedModelError, match="'mistral'"):
        DecoderConfig(model_type="mistral", **COMMON)
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        DecoderConfig(model_type="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0}, **COMMON)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_check_dtype_accepts(dtype):
    assert check_dtype(dtype) is dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.float8_e4m3fn])
def test_check_dtype_refuses(dtype):
    with pytest.raises(UnsupportedModelError, match="bfloat16") as info:
        check_dtype(dtype)
    assert str(dtype) in str(info.value)


@pytest.mark.parametrize(
    ("arch", "options"),
    [("qwen3", {}), ("qwen3", {"attention_bias": True}), ("qwen2", {}), ("llama", {}),
     ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {"tie_word_embeddings": False}),
     ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "mlp_only_layers": [1]})],
)  # fmt: skip
def test_parameters_are_hugging_faces(arch, options):
    """Every option that adds or removes a tensor gives the vexact training class exactly the
    parameter names and shapes of Hugging Face's own class (a checkpoint loads both ways)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vexact_vllm.model_patches.trainers.hf_causal_lm import TRAINING_CLASSES

    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, head_dim=16, tie_word_embeddings=True)  # fmt: skip
    config = AutoConfig.for_model(arch, **{**fields, **options})
    hf = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in TRAINING_CLASSES[arch](config).state_dict().items()}
    assert ours == hf
