"""The engine arguments a checkpoint's architecture asks for, on either side of a comparison: what the
check (--against-stock) and the bench add to both engines' `LLM(...)` arguments before the user's own
(`engine_for`: with the checkpoint stock loads, stock_layout.py).

- a hybrid decoder (Gated DeltaNet layers: Qwen3-Next, Qwen3.5): `enable_prefix_caching=False` on both
  sides (vexact refuses prefix caching for these models; stock runs like for like), and on stock's side,
  on CUDA without FlashInfer, vLLM's Triton GDN prefill (`gdn_prefill_backend="triton"`: vLLM picks
  FlashInfer's on Hopper and its engine dies at the first prefill where FlashInfer is not installed);
- a vision-language checkpoint (`vision_config` in its config.json: Qwen3.5 as published): stock runs its
  language model only (`language_model_only=True`: no vision tower, no multimodal profiling, which would
  need the checkpoint's image processor); vexact serves the text model of such checkpoints anyway.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch


def has_state_layers(model_path: str) -> bool:
    """The checkpoint's decoder has Gated DeltaNet layers (a hybrid family: Qwen3-Next, Qwen3.5)."""
    from transformers import AutoConfig

    from vexact_vllm.model_patches.config import DecoderConfig, UnsupportedModelError

    try:
        return DecoderConfig.from_hf(AutoConfig.from_pretrained(model_path)).linear is not None
    except (UnsupportedModelError, OSError, ValueError):
        return False  # vLLM's engine refuses it with its own message


def vision_language(model_path: str) -> bool:
    """The checkpoint's config.json is a vision-language layout (a `vision_config` beside the text model's)."""
    config = Path(model_path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def engine_for(model_path: str, stock: bool) -> tuple[str, dict]:
    """(the checkpoint the engine loads, the `LLM(...)` arguments it asks for) for `model_path`; `stock`:
    stock vLLM's engine, which loads stock_layout.py's published-layout twin where it needs one."""
    from .stock_layout import stock_checkpoint

    model = stock_checkpoint(model_path) if stock else model_path
    return model, model_engine_kwargs(model, stock)


def model_engine_kwargs(model_path: str, stock: bool) -> dict:
    """The `LLM(...)` arguments the checkpoint at `model_path` needs (module docstring); `stock`: for
    stock vLLM's engine (--model-impl vllm), else for vexact's."""
    kwargs = {}
    if stock and vision_language(model_path):
        kwargs["language_model_only"] = True
    if has_state_layers(model_path):
        kwargs["enable_prefix_caching"] = False
        if stock and torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is None:
            kwargs["gdn_prefill_backend"] = "triton"
    return kwargs
