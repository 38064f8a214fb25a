"""Engine-level refusals happen while vLLM builds its configuration, in the calling process (real vLLM
config objects, no engine), and again in the model's constructor as a post-condition; the same
engine arguments without `model_impl="vexact"` are not refused by us."""

from __future__ import annotations

import json
import shutil

import pytest

from vexact_vllm import MODEL_IMPL

pytestmark = pytest.mark.vllm


def _engine_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    import vexact_vllm

    vexact_vllm.register()
    return EngineArgs(model=str(model), **kwargs).create_engine_config()


@pytest.fixture(scope="module")
def float16_model(tiny_model, tmp_path_factory):
    """The tiny Qwen3 whose config.json says float16 (read by `--dtype auto`)."""
    path = tmp_path_factory.mktemp("fp16") / "tiny-qwen3-fp16"
    shutil.copytree(tiny_model("qwen3"), path)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(config))
    return path


class _CustomProcessor:  # never instantiated: the configuration is refused first
    pass


REFUSED = {
    "kv_cache_fp8": ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8 cannot keep rollouts bitwise equal"),
    "kv_cache_rounds_fp32": (
        {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
        "round the keys and values the trainer keeps in float32",
    ),
    "pipeline_stage_without_layer": ({"pipeline_parallel_size": 5}, "pipeline stage 4 of 5 would own layers .* no layer"),
    "logits_processors": ({"logits_processors": [_CustomProcessor]}, "custom logits processors .*_CustomProcessor"),
    "attention_backend": ({"attention_backend": "FLASH_ATTN"}, "--attention-backend FLASH_ATTN .* drop --attention-backend"),
    "dtype": ({"dtype": "float16"}, "dtype torch.float16 is not supported by vexact-vllm; use bfloat16 or float32"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_at_configuration(tiny_model, case):
    kwargs, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        _engine_config(tiny_model("qwen3"), model_impl=MODEL_IMPL, **kwargs)
    _engine_config(tiny_model("qwen3"), model_impl="auto", **kwargs)  # stock vLLM: not refused by us


def test_float16_checkpoint_refused_under_dtype_auto(float16_model):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="dtype torch.float16 is not supported by vexact-vllm"):
        _engine_config(float16_model, model_impl=MODEL_IMPL)
    with pytest.raises(ValueError, match="dtype torch.float16"):  # the model config alone already refuses
        EngineArgs(model=str(float16_model), model_impl=MODEL_IMPL).create_model_config()
    assert _engine_config(float16_model, model_impl="auto").model_config.dtype.is_floating_point
    assert _engine_config(float16_model, model_impl=MODEL_IMPL, dtype="bfloat16").model_config.architecture == (
        "VllmVexactQwen3ForCausalLM"
    )


def test_installed_logits_processor_plugins_are_refused(tiny_model, monkeypatch):
    from vexact_vllm import engine_checks

    monkeypatch.setattr(engine_checks, "_logits_processor_plugins", lambda: ["dummy (pkg.mod:Processor)"])
    with pytest.raises(ValueError, match=r"vllm.logits_processors entry points dummy \(pkg.mod:Processor\)"):
        _engine_config(tiny_model("qwen3"), model_impl=MODEL_IMPL)


def test_llm_refuses_before_any_engine_starts(tiny_model):
    from vllm import LLM

    import vexact_vllm

    vexact_vllm.register()
    with pytest.raises(ValueError, match="Every stage must own at least one layer"):
        LLM(model=tiny_model("qwen3"), model_impl=MODEL_IMPL, pipeline_parallel_size=5)  # 4 layers


def test_pipeline_partitions_giving_every_stage_a_layer_are_accepted(tiny_model, monkeypatch):
    """The tiny Qwen3 has 4 layers: vLLM's split over 2 or 4 stages, an uneven partition, and PP x TP."""
    for kwargs in ({"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 4},
                   {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}):  # fmt: skip
        config = _engine_config(tiny_model("qwen3"), model_impl=MODEL_IMPL, **kwargs)
        assert config.parallel_config.pipeline_parallel_size == kwargs["pipeline_parallel_size"]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    _engine_config(tiny_model("qwen3"), model_impl=MODEL_IMPL, pipeline_parallel_size=2)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,0")
    with pytest.raises(ValueError, match="pipeline stage 1 of 2 would own layers .* no layer"):
        _engine_config(tiny_model("qwen3"), model_impl=MODEL_IMPL, pipeline_parallel_size=2)


def test_tensor_parallel_sizes_the_heads_take_are_accepted(tiny_model):
    """The tiny Qwen3 has 4 heads and 2 kv heads: 2 and 4 split them (4: kv heads replicated)."""
    for size in (2, 4):
        config = _engine_config(tiny_model("qwen3"), model_impl=MODEL_IMPL, tensor_parallel_size=size)
        assert config.parallel_config.tensor_parallel_size == size


def test_every_vexact_architecture_has_the_config_hook():
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import vexact_vllm
    from vexact_vllm.engine_checks import VexactModelConfig
    from vexact_vllm.registry import VEXACT_ARCHITECTURES

    vexact_vllm.register()
    assert all(MODELS_CONFIG_MAP[name] is VexactModelConfig for name in VEXACT_ARCHITECTURES.values())


def test_the_model_checks_again_in_the_worker(tiny_model):
    """A configuration changed after the front-end checked it is refused by the model's constructor."""
    import torch
    from vllm.config import set_current_vllm_config

    from vexact_vllm.vllm_wrapper import VllmVexactForCausalLM

    cfg = _engine_config(tiny_model("qwen3"), model_impl=MODEL_IMPL, block_size=32)
    cfg.cache_config.cache_dtype = "fp8_e4m3"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(cfg), pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3"):
            VllmVexactForCausalLM(vllm_config=cfg)
    finally:
        torch.set_default_dtype(old)
