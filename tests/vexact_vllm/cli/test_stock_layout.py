"""A text-only Qwen3.5 checkpoint's published-layout twin for stock vLLM (cli/stock_layout.py): built only
where this vLLM has no text-only Qwen3.5, the same tensors under the vision-language names, the text
config inside a vision-language one that our DecoderConfig reads as the original, built once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from vexact_vllm.cli import stock_layout
from vexact_vllm.cli.stock_layout import mrope_sections, published_name, stock_checkpoint
from vexact_vllm.model_patches.config import DecoderConfig


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_twin_holds_the_same_tensors_under_the_published_names(tiny_model, tmp_path, monkeypatch, arch):
    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(stock_layout, "stock_serves", lambda name: False)
    path = tiny_model(arch)
    twin = Path(stock_checkpoint(path))
    assert twin != Path(path) and twin.is_relative_to(tmp_path)
    original, published = load_file(Path(path) / "model.safetensors"), load_file(twin / "model.safetensors")
    assert set(published) == {published_name(k) for k in original}
    assert all(torch.equal(published[published_name(k)], v) for k, v in original.items())
    assert any(k.startswith("model.language_model.layers.") for k in published)
    hf = AutoConfig.from_pretrained(twin)
    assert hf.architectures == [stock_layout.PUBLISHED[AutoConfig.from_pretrained(path).architectures[0]][0]]
    assert hf.text_config.rope_parameters["mrope_section"] == [3, 3, 2] and hf.vision_config.out_hidden_size == 128
    ours, theirs = (vars(DecoderConfig.from_hf(c)) for c in (hf, AutoConfig.from_pretrained(path)))
    assert {k: v for k, v in ours.items() if k not in ("model_type", "extra")} == {
        k: v for k, v in theirs.items() if k not in ("model_type", "extra")}  # the decoder itself  # fmt: skip
    assert (twin / "tokenizer.json").read_bytes() == (Path(path) / "tokenizer.json").read_bytes()
    stamp = (twin / "model.safetensors").stat().st_mtime_ns
    assert Path(stock_checkpoint(path)) == twin and (twin / "model.safetensors").stat().st_mtime_ns == stamp


def test_other_checkpoints_and_a_vllm_that_serves_it_get_the_checkpoint_itself(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VEXACT_VLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(stock_layout, "stock_serves", lambda name: False)
    assert stock_checkpoint(tiny_model("qwen3")) == tiny_model("qwen3")
    assert stock_checkpoint(str(tmp_path / "nothing")) == str(tmp_path / "nothing")
    monkeypatch.setattr(stock_layout, "stock_serves", lambda name: True)
    assert stock_checkpoint(tiny_model("qwen3_5_text")) == tiny_model("qwen3_5_text")
    assert not (tmp_path / "stock-layout").exists()


def test_sharded_index_and_names():
    assert published_name("model.layers.0.linear_attn.A_log") == "model.language_model.layers.0.linear_attn.A_log"
    assert published_name("lm_head.weight") == "lm_head.weight" and published_name("mtp.fc.weight") == "mtp.fc.weight"
    assert mrope_sections(64) == [11, 11, 10] and mrope_sections(16) == [3, 3, 2] and sum(mrope_sections(40)) == 20


def test_published_config_keeps_special_ids_inside_the_vocabulary():
    text = json.loads(json.dumps({"architectures": ["Qwen3_5ForCausalLM"], "head_dim": 256, "hidden_size": 2560,
                                  "vocab_size": 248320, "rope_parameters": {"partial_rotary_factor": 0.25}}))
    assert stock_layout.published_config(text)["image_token_id"] == 248056
    small = stock_layout.published_config({**text, "vocab_size": 448})
    assert [small[k] for k in stock_layout.TOKEN_IDS] == [444, 445, 446, 447]
    assert small["text_config"]["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert "architectures" not in small["text_config"]
