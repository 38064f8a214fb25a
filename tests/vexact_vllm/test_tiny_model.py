"""The built-in tiny checkpoints load offline in transformers and are deterministic per seed."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from vexact_vllm.kernels.settings import refresh_settings
from vexact_vllm.tiny_model import (
    CACHE_VERSION,
    TINY_ARCHS,
    build_tiny_model,
    build_tokenizer,
    default_cache_dir,
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One checkpoint per arch, built once for the module (in its own tmp dir)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(arch, path=root / arch) for arch in TINY_ARCHS}


def test_default_cache_dir(tmp_path, monkeypatch):
    assert default_cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("VEXACT_VLLM_CACHE")
    refresh_settings()  # the settings are read once
    assert default_cache_dir() == Path.home() / ".cache" / "vexact-vllm"


def test_tokenizer(tmp_path, built):
    build_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (built["qwen3"] / "tokenizer.json").read_bytes()
    for s in ["The capital of France is", "1 plus 1 is", "12 plus 7 is 19.", "Hello, world! (x=3; y?)",
              "café naïve Zürich 日本語", "  leading spaces\nand a newline\t"]:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
    assert 4 <= len(tok.encode("The capital of France is")) <= 12
    assert len(tok.encode("1 plus 1 is")) >= 3
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == eos and tok.pad_token_id == eos
    for special in ("<|im_start|>", "<|im_end|>"):
        assert tok.encode(special, add_special_tokens=False) == [tok.convert_tokens_to_ids(special)]
    cfg = AutoConfig.from_pretrained(built["qwen3"])
    assert len(tok) <= cfg.vocab_size and cfg.vocab_size % 64 == 0
    assert len(tok) < cfg.vocab_size  # padding rows past the tokenizer
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id == eos


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_auto_tokenizer_matches_tokenizer_json(arch, built):
    """AutoTokenizer may rebuild the pipeline per model_type (qwen2 does): it must tokenize the same."""
    raw = Tokenizer.from_file(str(built[arch] / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(built[arch])
    for s in ["The capital of France is", "1 plus 1 is 2.", "x  =  123456;\n\n  y's 'll", "café 日本語 ½ Ⅻ",
              "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(s, add_special_tokens=False) == raw.encode(s, add_special_tokens=False).ids, s


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe"])  # others: test_tiny_deepseek.py, test_tiny_qwen3_5.py
def test_arch_loads(arch, built):
    path = built[arch]
    cfg = AutoConfig.from_pretrained(path)
    assert type(cfg) is {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}[arch]
    assert cfg.architectures == [type(cfg).__name__.replace("Config", "ForCausalLM")]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == 32  # qwen2: no field
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    assert cfg.tie_word_embeddings is (arch not in ("llama", "qwen3_moe"))
    if arch == "qwen3_moe":  # 8 experts, top-2, one dense layer among four
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_only_layers) == (8, 2, [1])
    if arch == "llama":
        assert cfg.rope_parameters == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 256}
    else:
        assert cfg.rope_parameters["rope_type"] == "default"
    gen = (path / "generation_config.json").read_text()
    assert "temperature" not in gen and "top_p" not in gen

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()

    sd = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert ("lm_head.weight" in sd) is (arch in ("llama", "qwen3_moe"))
    if arch == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in sd
        assert sd["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    if arch == "qwen2":
        assert all(sd[f"model.layers.{i}.self_attn.{p}_proj.bias"].abs().sum() > 0
                   for i in range(4) for p in "qkv")
    for name, t in sd.items():
        if "norm" in name:
            assert torch.equal(t, torch.ones_like(t)), name
        elif t.dim() == 2:
            assert abs(t.float().std().item() - 0.02) < 0.002, name


def test_deterministic_and_cached(tmp_path):
    a = build_tiny_model("qwen3", path=tmp_path / "a", seed=0)
    b = build_tiny_model("qwen3", path=tmp_path / "b", seed=0)
    c = build_tiny_model("qwen3", path=tmp_path / "c", seed=1)
    data = (a / "model.safetensors").read_bytes()
    assert data == (b / "model.safetensors").read_bytes()
    assert data != (c / "model.safetensors").read_bytes()

    d = build_tiny_model("qwen3")  # default location, under the monkeypatched cache
    assert d == tmp_path / "cache" / f"tiny-qwen3-s0-{CACHE_VERSION}"
    assert (d / "model.safetensors").read_bytes() == data
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model("qwen3") == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    assert build_tiny_model("qwen3", force=True) == d
    assert (d / "model.safetensors").stat().st_mtime_ns != mtime
    assert (d / "model.safetensors").read_bytes() == data
    assert [p.name for p in d.parent.iterdir()] == [d.name]  # no temporary leftovers


def test_transformers_written_archs_deterministic(tmp_path):
    for arch in ("qwen2", "llama"):
        x = build_tiny_model(arch, path=tmp_path / f"{arch}-x")
        y = build_tiny_model(arch, path=tmp_path / f"{arch}-y")
        sx, sy = load_file(x / "model.safetensors"), load_file(y / "model.safetensors")
        assert sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) for k in sx)


def test_incomplete_dir_is_rebuilt(tmp_path):
    path = tmp_path / "partial"
    path.mkdir()
    (path / "config.json").write_text("{}")
    build_tiny_model("qwen3", path=path)
    assert AutoConfig.from_pretrained(path).model_type == "qwen3"


def test_unknown_arch():
    with pytest.raises(ValueError, match="unknown tiny arch"):
        build_tiny_model("gpt2")
