"""Tiny random-weight checkpoints, built locally with no download, for tests and `vexact-vllm check`.

Each checkpoint is a normal Hugging Face model directory (`config.json`, `generation_config.json`,
`model.safetensors`, a fast tokenizer) that transformers and vLLM load offline:

- tokenizer: a real byte-level BPE (384 entries, Qwen2's NFC + regex split + ByteLevel pipeline)
  trained with `tokenizers` on a corpus generated here (built-in English paragraphs plus arithmetic
  and counting sentences), so ordinary prompts take several tokens. `<|endoftext|>` is eos, bos
  and pad; `<|im_start|>` / `<|im_end|>` are special too (ChatML). The DeepSeek families' tokenizer
  is trained the same with DeepSeek's special tokens and turn markers (`TOKENIZER_STYLES`): verl's
  DeepSeek prompt builder requires `<｜end▁of▁sentence｜>`, as real DeepSeek checkpoints define it.
- qwen3 (the default): tensors drawn by us from a seeded `torch.Generator` in a fixed name order,
  2-D weights ~ N(0, 0.02), norm weights exactly 1, saved in bf16 with HF's parameter names. The
  file is byte-identical for a given seed.
- qwen2, llama: written by transformers itself (`from_config` + explicit re-initialisation, so
  the qwen2 q/k/v biases are nonzero, then `save_pretrained`). llama uses llama3 rope scaling.

vocab_size is the tokenizer length rounded up to the next multiple of 64 strictly above it, so
there are always embedding rows past the tokenizer, as in real checkpoints.

Shape stand-ins (`builtin_model("qwen3-1.7b-shape")`, `vexact-vllm check --model qwen3-1.7b-shape`):
a real model's architecture and shapes (Qwen3-1.7B: 28 layers, hidden 2048, 16/8 heads of 128,
vocabulary 151936, tied embeddings, rope theta 1e6) with weights drawn like the tiny qwen3's and
streamed to disk tensor by tensor (~3.4 GB in bf16), and the tiny tokenizer: sampled ids past the
tokenizer are normal there, so callers do not detokenize.

A build is written into a temporary sibling directory and renamed into place only when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from vexact_vllm.kernels.settings import get_settings
from vexact_vllm.model_patches.families import BY_MODEL_TYPE, FAMILIES
from vexact_vllm.model_shapes import BUILTIN_MODELS, CONFIG_ONLY_SHAPES, SHAPES

TINY_ARCHS = tuple(f.model_type for f in FAMILIES if f.tiny is not None)  # the built-in tiny checkpoints
CACHE_VERSION = "v2"  # bump when the tokenizer, configs or weights change
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
DEEPSEEK_SPECIAL_TOKENS = ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
TOKENIZER_VOCAB_SIZE = 384
INIT_STD = 0.02  # Hugging Face's initializer_range
# The tiny DeepSeek-V3's router correction bias: the size of its sigmoid scores' spread, so it changes
# which experts win (and with groups, which groups) without deciding every choice alone.
CORRECTION_BIAS_STD = 0.01
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json")
# Qwen2's pre-tokenizer split: words with one leading non-letter, single digits, punctuation runs, spaces.
_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                      r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# DeepSeek-V3's turn layout (its template without tools): system text first, user turns after <｜User｜>,
# assistant turns after <｜Assistant｜> closed by <｜end▁of▁sentence｜>.
_DEEPSEEK_CHAT_TEMPLATE = (
    "<｜begin▁of▁sentence｜>{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
# Family.tokenizer -> (special tokens, eos first; chat template)
TOKENIZER_STYLES = {"chatml": (SPECIAL_TOKENS, _CHAT_TEMPLATE),
                    "deepseek": (DEEPSEEK_SPECIAL_TOKENS, _DEEPSEEK_CHAT_TEMPLATE)}  # fmt: skip

_PARAGRAPHS = (
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. "
    "The capital of Spain is Madrid. The capital of Japan is Tokyo. The capital of Canada is Ottawa.",
    "Once upon a time there was a small village by the river. The people of the village worked in "
    "the fields in the morning and told stories in the evening. Every child knew the name of every "
    "tree, and every tree knew the songs of the children.",
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
    "step. Knowledge is power, and time is money. Where there is a will, there is a way.",
    "In mathematics, a number is prime if it has exactly two divisors. The first prime numbers are "
    "two, three, five, seven, eleven and thirteen. The sum of two even numbers is always even.",
    "The sun rises in the east and sets in the west. Water boils at one hundred degrees. The moon "
    "goes around the earth, and the earth goes around the sun. Light is faster than sound.",
    "Question: What is the color of the sky? Answer: The sky is blue. Question: How many days are "
    "in a week? Answer: There are seven days in a week. Question: Who wrote this? Answer: We did.",
)
_NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
                 "fifteen sixteen seventeen eighteen nineteen twenty").split()


def default_cache_dir() -> Path:
    """`$VEXACT_VLLM_CACHE` if set, else `~/.cache/vexact-vllm` (the settings' `cache_dir`)."""
    return get_settings().cache_dir


def _corpus() -> list[str]:
    """The deterministic training corpus: paragraphs, arithmetic and counting sentences."""
    lines = [p for p in _PARAGRAPHS for _ in range(3)]
    for a in range(21):
        for b in range(21):
            lines.append(f"{a} plus {b} is {a + b}. {a + b} minus {b} is {a}. {a} times {b} is {a * b}.")
    for n in range(1, 21):
        lines.append("Counting: " + ", ".join(str(i) for i in range(n, n + 10)) + ".")
        lines.append(" ".join(_NUMBER_WORDS[: n + 1]).capitalize() + ".")
    return lines


def _train_tokenizer(specials: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Qwen2's exact pipeline: AutoTokenizer rebuilds it for model_type qwen2 whatever tokenizer.json
    # says, so any other pre-tokenizer would tokenize differently there than in tokenizer.json.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, min_frequency=2, special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tokenizer(path: Path, style: str = "chatml") -> str:
    """Train the byte-level BPE tokenizer with `style`'s special tokens (TOKENIZER_STYLES) and save it to
    `path` as a Hugging Face fast tokenizer; returns its eos token."""
    specials, template = TOKENIZER_STYLES[style]
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(specials), eos_token=specials[0], pad_token=specials[0],
        additional_special_tokens=list(specials[1:]), chat_template=template, model_max_length=2048,
    )
    hf_tok.save_pretrained(str(path))
    return specials[0]


def tokenizer_style(model_type: str) -> str:
    """The TOKENIZER_STYLES key of a checkpoint of `model_type`: its family's, ChatML for others."""
    family = BY_MODEL_TYPE.get(model_type)
    return family.tokenizer if family is not None else "chatml"


def _make_config(arch: str, vocab_size: int, special_id: int) -> PretrainedConfig:
    """The built-in tiny config of family `arch` (a model_type: the family table's `tiny` fields)."""
    if arch not in BY_MODEL_TYPE:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")
    family = BY_MODEL_TYPE[arch]
    return family.hf_config_class()(
        **family.tiny, vocab_size=vocab_size, bos_token_id=special_id, eos_token_id=special_id,
        pad_token_id=special_id, dtype="bfloat16", architectures=[family.architecture],
    )


def qwen3_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """HF Qwen3ForCausalLM parameter names and shapes, in the fixed order the weights are drawn."""
    H, F, D = config.hidden_size, config.intermediate_size, config.head_dim  # hidden, ffn, head dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, H)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (config.num_attention_heads * D, H),
            p + "self_attn.k_proj.weight": (config.num_key_value_heads * D, H),
            p + "self_attn.v_proj.weight": (config.num_key_value_heads * D, H),
            p + "self_attn.o_proj.weight": (H, config.num_attention_heads * D),
            p + "self_attn.q_norm.weight": (D,),
            p + "self_attn.k_norm.weight": (D,),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (F, H),
            p + "mlp.up_proj.weight": (F, H),
            p + "mlp.down_proj.weight": (H, F),
        }
    shapes["model.norm.weight"] = (H,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, H)
    return shapes


def _qwen3_tensors(config: Qwen3Config, seed: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, drawn in `qwen3_shapes` order from one seeded generator:
    2-D weights ~ N(0, INIT_STD) drawn in fp32 then rounded to `dtype`, norm weights exactly 1.
    Only one fp32 tensor exists at a time."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in qwen3_shapes(config).items():
        if len(shape) == 1:  # norm weight
            yield name, torch.ones(shape, dtype=dtype)
        else:
            yield name, torch.randn(shape, generator=gen, dtype=torch.float32).mul_(INIT_STD).to(dtype)


def qwen3_state_dict(config: Qwen3Config, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF Qwen3ForCausalLM tensors, drawn in a fixed name order from one seeded generator."""
    return dict(_qwen3_tensors(config, seed, dtype))


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def _stream_safetensors(path: Path, config: Qwen3Config, seed: int, dtype: torch.dtype) -> None:
    """Write `_qwen3_tensors` to a safetensors file tensor by tensor (the header first: it needs only
    names and shapes), so a multi-GB checkpoint never sits in memory whole. Data in draw order."""
    shapes = qwen3_shapes(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, tensor in _qwen3_tensors(config, seed, dtype):
            assert tuple(tensor.shape) == shapes[name]
            f.write(tensor.contiguous().view(torch.uint8).numpy().data)


def _save_with_transformers(
    config: PretrainedConfig, path: Path, seed: int, dtype: torch.dtype, std: float = INIT_STD, auto_class=None
) -> None:
    """Instantiate with transformers, re-initialise every tensor explicitly, `save_pretrained`. DeepSeek-V3's
    routers' `e_score_correction_bias` (a buffer, zero at init) is drawn ~ N(0, CORRECTION_BIAS_STD) and
    saved in fp32, as DeepSeek's checkpoints keep it. Gated DeltaNet's A_log is drawn in transformers' range
(log U(0.01, 16)), its dt_bias 1, as transformers initialises them; every norm weight is 1 (the
zero-centred ones of Qwen3-Next / Qwen3.5 thus scale by 2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (auto_class or AutoModelForCausalLM).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied lm_head appears once, as embed_tokens
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("A_log"):  # Gated DeltaNet's decay rates, transformers' range: log U(0.01, 16)
                param.copy_(torch.rand(param.shape, generator=gen).mul_(15.99).add_(0.01).log_())
            elif name.endswith("dt_bias"):
                param.fill_(1.0)
            else:  # Linear/Embedding weights and biases
                param.normal_(0.0, std, generator=gen)
        biases = {name: torch.randn(buf.shape, generator=gen) * CORRECTION_BIAS_STD
                  for name, buf in sorted(model.named_buffers()) if name.endswith("e_score_correction_bias")}  # fmt: skip
    model.to(dtype)
    for module_name, module in model.named_modules():
        name = f"{module_name}.e_score_correction_bias"
        if name in biases:
            module.e_score_correction_bias = biases[name]  # fp32 after the cast, as on disk
    model.save_pretrained(str(path), safe_serialization=True)


def _is_complete(path: Path, weights: bool = True) -> bool:
    return all((path / f).is_file() for f in _REQUIRED_FILES if weights or f != "model.safetensors")


def _build(path: Path, force: bool, weights: bool, write, model_type: str = "qwen3") -> Path:
    """Reuse a complete `path`, or run `write(tmp)` in a temporary sibling and rename it into place
    (so an interrupted build never looks complete). `write` gets the tokenizer's eos id too; the
    tokenizer is `model_type`'s (tokenizer_style)."""
    if _is_complete(path, weights) and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        eos = build_tokenizer(tmp, tokenizer_style(model_type))
        tok = AutoTokenizer.from_pretrained(str(tmp))
        config = write(tmp, len(tok), tok.convert_tokens_to_ids(eos))
        # Only the special ids, no sampling defaults (overwrites the one save_pretrained wrote).
        text = config.get_text_config()  # a vision-language config keeps them in its text_config
        gen_cfg = {k: getattr(text, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        GenerationConfig(**gen_cfg).save_pretrained(str(tmp))
        _install(tmp, path, weights)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_config_is_current(path: Path, arch: str) -> bool:
    """False when `path` holds a config.json whose scalar fields differ from the family table's tiny
    fields (a checkpoint cached before the table changed): build_tiny_model rebuilds it. True when there
    is no config yet (nothing stale to replace). Fields the config class renames on save are not compared."""
    try:
        saved = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return True
    fields = BY_MODEL_TYPE[arch].tiny
    scalars = {k: v for k, v in fields.items() if v is None or isinstance(v, (bool, int, float, str))}
    return all(saved[k] == v for k, v in scalars.items() if k in saved)


def build_tiny_model(arch: str = "qwen3", path: Path | str | None = None, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, force: bool = False) -> Path:
    """Build (or reuse) a tiny random checkpoint of `arch`; return its directory.

    Default location: `default_cache_dir() / f"tiny-{arch}-s{seed}-{CACHE_VERSION}"`. An existing complete
    directory is reused unless `force` or its config differs from the family table's (tiny_config_is_current).
    The build goes to a temporary sibling and is renamed into
    place at the end, so an interrupted build never looks complete.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")
    path = Path(path) if path is not None else default_cache_dir() / f"tiny-{arch}-s{seed}-{CACHE_VERSION}"
    force = force or not tiny_config_is_current(path, arch)

    def write(tmp: Path, tokenizer_len: int, special_id: int) -> PretrainedConfig:
        vocab_size = (tokenizer_len // 64 + 1) * 64  # strictly above: always some padding rows
        config = _make_config(arch, vocab_size, special_id)
        if arch == "qwen3":
            config.save_pretrained(str(tmp))
            save_file(qwen3_state_dict(config, seed, dtype), str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
        else:
            _save_with_transformers(config, tmp, seed, dtype)
        return config

    return _build(path, force, True, write, arch)


def build_random_model(
    model_type: str, fields: dict, path: Path | str, seed: int = 0, std: float = INIT_STD, force: bool = False
) -> Path:
    """Build (or reuse) a random-weight checkpoint of any transformers `model_type` ("qwen3", "llama",
    ...) at `path`: its config from `fields` (vocab_size is raised to cover the tiny tokenizer if
    smaller), the tiny tokenizer, every weight ~ N(0, std) from `seed`, norms 1, bf16. For the fuzzer
    and tests that need shapes the built-ins do not have."""
    from transformers import AutoConfig

    def write(tmp: Path, tokenizer_len: int, special_id: int) -> PretrainedConfig:
        specials = dict(bos_token_id=special_id, eos_token_id=special_id, pad_token_id=special_id)
        config = AutoConfig.for_model(model_type, **{**specials, "dtype": "bfloat16", **fields})
        config.vocab_size = max(config.vocab_size, tokenizer_len)
        _save_with_transformers(config, tmp, seed, torch.bfloat16, std)
        return config

    return _build(Path(path), force, True, write, model_type)


def build_from_config_file(config_file: Path | str, path: Path | str, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) a random-weight checkpoint at `path` whose config.json is `config_file` as written
    (a vision-language checkpoint's layout: text_config, vision_config, M-RoPE fields), with the tiny
    tokenizer (its special ids replace the file's eos_token_id) and every weight drawn as the tiny ones,
    the vision tower's included (transformers' image-text-to-text class for the config)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    layout = json.loads(Path(config_file).read_text())

    def write(tmp: Path, tokenizer_len: int, special_id: int) -> PretrainedConfig:
        text = layout.get("text_config", layout)
        if text["vocab_size"] < tokenizer_len:
            raise ValueError(f"vocab_size {text['vocab_size']} is below the tokenizer's {tokenizer_len}")
        text["eos_token_id"] = special_id
        (tmp / "config.json").write_text(json.dumps(layout, indent=2) + "\n")
        config = AutoConfig.from_pretrained(str(tmp))
        auto = AutoModelForImageTextToText if "vision_config" in layout else AutoModelForCausalLM
        _save_with_transformers(config, tmp, seed, torch.bfloat16, auto_class=auto)
        (tmp / "config.json").write_text(json.dumps(layout, indent=2) + "\n")  # the file's layout, not the re-save
        config.bos_token_id = config.pad_token_id = config.eos_token_id = special_id
        return config

    return _build(Path(path), force, True, write, layout.get("model_type", ""))


def shape_config(model_type: str, fields: dict, special_id: int) -> PretrainedConfig:
    """The config of family `model_type` with `fields` (a QWEN3_1_7B_SHAPE-like dict), bf16, special ids set.
    The rotary embedding: `fields["rope_parameters"]` when given (YaRN), else the default one at `rope_theta`.
    A vision-language family (`text_config`: Qwen3.5 as published) takes `fields` as its text_config, with
    a vision_config of transformers' defaults whose output width is the text model's."""
    fields = dict(fields)
    rope = fields.pop("rope_parameters", None) or {"rope_type": "default", "rope_theta": float(fields.pop("rope_theta"))}
    family = BY_MODEL_TYPE[model_type]
    specials = dict(bos_token_id=special_id, eos_token_id=special_id, pad_token_id=special_id)
    if family.text_config:
        text = {**fields, "rope_parameters": rope, **specials, "dtype": "bfloat16"}
        return family.hf_config_class()(
            text_config=text, vision_config={"out_hidden_size": fields["hidden_size"]},
            tie_word_embeddings=fields.get("tie_word_embeddings", False), dtype="bfloat16",
            architectures=[family.architecture],
        )
    return family.hf_config_class()(
        **fields, rope_parameters=rope, **specials, dtype="bfloat16", architectures=[family.architecture],
    )


def qwen3_shape_config(shape: dict, special_id: int) -> Qwen3Config:
    """A Qwen3ForCausalLM config of `shape` (a QWEN3_1_7B_SHAPE-like dict), bf16, special ids set."""
    return shape_config("qwen3", shape, special_id)


def build_qwen3_shape(shape: dict, path: Path | str, seed: int = 0, weights: bool = True,
                      force: bool = False) -> Path:
    """Build (or reuse) a random-weight Qwen3 checkpoint of `shape` at `path`, with the tiny tokenizer.

    The weights are drawn like the tiny qwen3's (seeded normal, std 0.02, norms 1, bf16) and streamed
    to `model.safetensors` one tensor at a time: byte-identical for a given shape and seed.
    `weights=False` writes only the config, generation config and tokenizer (enough for vLLM's
    `load_format="dummy"`). The vocabulary may exceed the tokenizer's, as Qwen's padded one does.
    """
    if sys.byteorder != "little":
        raise RuntimeError("writing safetensors needs a little-endian host")

    def write(tmp: Path, tokenizer_len: int, special_id: int) -> PretrainedConfig:
        config = qwen3_shape_config(shape, special_id)
        if config.vocab_size < tokenizer_len:
            raise ValueError(f"vocab_size {config.vocab_size} is below the tokenizer's {tokenizer_len}")
        config.save_pretrained(str(tmp))
        if weights:
            _stream_safetensors(tmp / "model.safetensors", config, seed, torch.bfloat16)
        return config

    return _build(Path(path), force, weights, write)


def _write_shape_config(model_type: str, fields: dict, path: Path, special_id: int) -> PretrainedConfig:
    config = shape_config(model_type, fields, special_id)
    config.save_pretrained(str(path))
    return config


def builtin_model(name: str, seed: int = 0, weights: bool = True) -> str:
    """The directory of the built-in model `name` (one of BUILTIN_MODELS), built on first use, as a
    `str`: what `LLM(...)`, `vllm serve` and `from_pretrained` take.

    `tiny-<arch>`: build_tiny_model(arch). A shape name (`qwen3-1.7b-shape`): build_qwen3_shape in
    `default_cache_dir() / f"{name}-s{seed}-{CACHE_VERSION}"`, or `f"{name}-config-{CACHE_VERSION}"` without weights.
    """
    return str(_builtin_model(name, seed, weights))


def _builtin_model(name: str, seed: int, weights: bool) -> Path:
    tiny = {f.tiny_name: f.model_type for f in FAMILIES if f.tiny is not None}
    if name in tiny:
        return build_tiny_model(tiny[name], seed=seed)
    if name in CONFIG_ONLY_SHAPES:
        if weights:
            raise ValueError(f"{name} is a benchmark stand-in without weights; use it with --load-format dummy")
        model_type, fields = CONFIG_ONLY_SHAPES[name]
        return _build(default_cache_dir() / f"{name}-config-{CACHE_VERSION}", False, False,
                      lambda tmp, tok_len, special_id: _write_shape_config(model_type, fields, tmp, special_id),
                      model_type)
    if name not in SHAPES:
        raise ValueError(f"unknown built-in model {name!r}; expected one of {', '.join(BUILTIN_MODELS)}")
    suffix = f"s{seed}" if weights else "config"
    return build_qwen3_shape(SHAPES[name], default_cache_dir() / f"{name}-{suffix}-{CACHE_VERSION}", seed, weights)


def _install(tmp: Path, path: Path, weights: bool = True) -> None:
    """Rename the finished `tmp` onto `path`, replacing an old or partial directory there."""
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rename(path, old / "d")
    try:
        os.rename(tmp, path)
    except OSError:  # a concurrent builder installed its own copy first: keep it if complete
        if not _is_complete(path, weights):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

