"""The engine arguments a checkpoint asks for (cli/model_engine.py): a hybrid's prefix caching off on both
sides and stock's Triton Gated DeltaNet prefill where FlashInfer's would be picked (CUDA) and is not
installed; a vision-language checkpoint's language model only, for stock."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from vexact_vllm.cli import model_engine, stock_layout
from vexact_vllm.cli.model_engine import engine_for, model_engine_kwargs, vision_language


def _checkpoint(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


@pytest.mark.parametrize(("cuda", "flashinfer", "hybrid", "triton"), [
    (True, False, True, True), (True, True, True, False), (True, False, False, False), (False, False, True, False)])
def test_hybrid_prefix_caching_and_stock_gdn_prefill(tmp_path, monkeypatch, cuda, flashinfer, hybrid, triton):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if flashinfer else None) if name == "flashinfer"
                        else real_find_spec(name, *a))  # fmt: skip
    monkeypatch.setattr(model_engine, "has_state_layers", lambda path: hybrid)
    path = _checkpoint(tmp_path, head_dim=128)
    stock, vexact = model_engine_kwargs(path, stock=True), model_engine_kwargs(path, stock=False)
    assert stock.get("gdn_prefill_backend") == ("triton" if triton else None)
    assert vexact == ({"enable_prefix_caching": False} if hybrid else {})
    assert {k: v for k, v in stock.items() if k != "gdn_prefill_backend"} == vexact


def test_vision_language_checkpoint_runs_stocks_language_model_only(tmp_path, monkeypatch):
    monkeypatch.setattr(model_engine, "has_state_layers", lambda path: False)
    (tmp_path / "vl").mkdir()
    vl = _checkpoint(tmp_path / "vl", text_config={}, vision_config={})
    text = _checkpoint(tmp_path, head_dim=128)
    assert vision_language(vl) and not vision_language(text) and not vision_language(str(tmp_path / "none"))
    assert model_engine_kwargs(vl, stock=True) == {"language_model_only": True}
    assert model_engine_kwargs(vl, stock=False) == {} == model_engine_kwargs(text, stock=True)


def test_hybrid_checkpoints_are_told_apart(tiny_model):
    assert model_engine.has_state_layers(tiny_model("qwen3_5_text"))
    assert not model_engine.has_state_layers(tiny_model("qwen3"))
    assert not model_engine.has_state_layers("/nonexistent/checkpoint")


def test_engine_for_asks_of_the_checkpoint_each_side_loads(tmp_path, monkeypatch):
    """Stock loads stock_layout's twin and its arguments are the twin's; vexact loads the checkpoint itself."""
    monkeypatch.setattr(model_engine, "has_state_layers", lambda path: False)
    (tmp_path / "twin").mkdir()
    twin = _checkpoint(tmp_path / "twin", text_config={}, vision_config={})
    text = _checkpoint(tmp_path, head_dim=128)
    monkeypatch.setattr(stock_layout, "stock_checkpoint", lambda path: twin)
    assert engine_for(text, stock=True) == (twin, {"language_model_only": True})
    assert engine_for(text, stock=False) == (text, {})
