"""A text-only Qwen3.5 checkpoint in the layout Qwen publishes, for stock vLLM where it has no text-only
Qwen3.5 architecture (vLLM 0.26 registers only Qwen3_5(Moe)ForConditionalGeneration): `--against-stock`
and the bench run stock on this twin. The same tensors under the vision-language model's names
("model." -> "model.language_model.", lm_head and the rest as they are); its config.json the text
config inside a vision-language one (M-RoPE sections of the rotary dims, interleaved, as published; a
one-layer vision tower that stock never builds: it runs the language model only, model_engine.py);
every other file copied. Built once under the vexact cache, keyed by the checkpoint's path and its
files' sizes and times (a weight-free checkpoint, the bench's config-only shapes, gets a weight-free twin).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# text-only architecture -> (the published vision-language architecture, its model_type)
PUBLISHED = {
    "Qwen3_5ForCausalLM": ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
}
# The published checkpoints' special ids of images and video (used only where they fit the vocabulary).
TOKEN_IDS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
             "vision_end_token_id": 248054}  # fmt: skip
# A vision tower stock never builds (language model only), the smallest the config class takes.
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 4,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
          "deepstack_visual_indexes": [], "model_type": "qwen3_5"}  # fmt: skip
_WEIGHTS = ".safetensors"
_INDEX = "model.safetensors.index.json"


def stock_checkpoint(model_path: str) -> str:
    """The checkpoint stock vLLM should load for `model_path`: the published-layout twin of a text-only
    Qwen3.5 that this vLLM cannot serve as it is, else `model_path` itself."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return model_path
    config = json.loads(config_file.read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in PUBLISHED or stock_serves(arch):
        return model_path
    return str(published_twin(Path(model_path), config))


def stock_serves(arch: str) -> bool:
    """Whether this vLLM has a model class of its own for `arch`."""
    from vllm.model_executor.models import ModelRegistry

    return arch in ModelRegistry.get_supported_archs()


def mrope_sections(rotary_dim: int) -> list[int]:
    """M-RoPE's (temporal, height, width) split of the rotary pairs, in the published proportion
    (11, 11, 10 of 32 pairs): a text token's three positions are one, so any split rotates it alike."""
    pairs = rotary_dim // 2
    first = -(-pairs * 11 // 32)
    return [first, first, pairs - 2 * first]


def published_config(text: dict) -> dict:
    """The vision-language config.json around a text-only Qwen3.5 config.json's fields."""
    arch, model_type = PUBLISHED[text["architectures"][0]]
    rope = dict(text.get("rope_parameters") or {})
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    rope.setdefault("mrope_section", mrope_sections(int(text["head_dim"] * factor)))
    rope.setdefault("mrope_interleaved", True)
    vocab = text["vocab_size"]
    ids = {k: v if v < vocab else vocab - len(TOKEN_IDS) + i for i, (k, v) in enumerate(TOKEN_IDS.items())}
    inner = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    return {"architectures": [arch], "model_type": model_type, **ids,
            "text_config": {**inner, "rope_parameters": rope},
            "vision_config": {**VISION, "out_hidden_size": text["hidden_size"]},
            "tie_word_embeddings": text.get("tie_word_embeddings", False)}  # fmt: skip


def published_name(name: str) -> str:
    """A text-only checkpoint's tensor name under the vision-language model."""
    return "model.language_model." + name[len("model.") :] if name.startswith("model.") else name


def published_twin(path: Path, config: dict) -> Path:
    """Build (or reuse) the twin of the checkpoint at `path` (module docstring)."""
    from vexact_vllm.tiny_model import default_cache_dir

    files = sorted(f for f in path.iterdir() if f.is_file())
    key = json.dumps([str(path.resolve()), [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]])
    twin = default_cache_dir() / "stock-layout" / f"{path.name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (twin / "config.json").is_file():
        return twin
    twin.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{twin.name}.tmp-", dir=twin.parent))
    try:
        for f in files:
            if f.name.endswith(_WEIGHTS):
                _rename_tensors(f, tmp / f.name)
            elif f.name == _INDEX:
                index = json.loads(f.read_text())
                index["weight_map"] = {published_name(k): v for k, v in index["weight_map"].items()}
                (tmp / f.name).write_text(json.dumps(index, indent=2))
            elif f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(published_config(config), indent=2) + "\n")  # last: complete
        os.rename(tmp, twin)
    except OSError:
        if not (twin / "config.json").is_file():  # not a concurrent builder's finished twin
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return twin


def _rename_tensors(src: Path, dst: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        metadata = f.metadata()
        tensors = {published_name(name): f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(dst), metadata=metadata)
