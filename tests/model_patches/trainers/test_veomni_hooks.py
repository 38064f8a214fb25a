"""veomni_hooks: VeOmni's modeling registry, kernel registry and loss mapping, through VeOmni's own
`get_model_class`, `build_foundation_model`, `OpSlot.bind` and `apply_ops_config`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("veomni")

from transformers import AutoConfig  # noqa: E402

from vexact_vllm.model_patches.trainers import veomni_hooks  # noqa: E402
from vexact_vllm.model_patches.trainers.veomni_classes import (  # noqa: E402
    VEOMNI_CLASSES,
    veomni_causal_lm_loss,
    vexact_causal_lm_loss,
)

from .veomni_cpu import veomni_process_state  # noqa: E402


def _ops(**overrides):
    from veomni.arguments import OpsImplementationConfig

    eager = dict.fromkeys(
        ("cross_entropy_loss", "rms_norm", "swiglu_mlp", "rotary_pos_emb", "moe", "load_balancing_loss"), "eager"
    )
    eager.update(overrides)
    return OpsImplementationConfig(
        attn_implementation="flash_attention_2", **{f"{k}_implementation": v for k, v in eager.items()}
    )


def _build(config, **ops):
    from veomni.models.auto import build_foundation_model

    torch.manual_seed(0)
    return build_foundation_model(config, torch_dtype="bfloat16", ops_implementation=_ops(**ops), init_device="cpu")


@pytest.fixture
def hooks():
    with veomni_process_state(), veomni_hooks.installed():
        yield


def _config(tiny_model, arch, architectures=None):
    config = AutoConfig.from_pretrained(tiny_model(arch))
    if architectures is not None:
        config.architectures = architectures
    return config


def test_install_is_idempotent_and_reversible():
    """uninstall() restores VeOmni's registry (its local overrides included), its loss-mapping installer
    and the transformers LOSS_MAPPING entries that the installer wrote for "vexact", by identity."""
    import veomni.ops.kernels.cross_entropy as cross_entropy
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.models.loader import MODELING_REGISTRY

    was = veomni_hooks.is_installed()  # enable() may have installed them
    veomni_hooks.uninstall()
    before = {t: MODELING_REGISTRY[t] for t in veomni_hooks.VEOMNI_MODEL_TYPES}
    local = dict(MODELING_REGISTRY._local_mapping)
    installer = cross_entropy.install_loss_mapping
    mapping = dict(LOSS_MAPPING)
    with veomni_hooks.installed():
        entries = {t: MODELING_REGISTRY[t] for t in veomni_hooks.VEOMNI_MODEL_TYPES}
        veomni_hooks.install()
        assert {t: MODELING_REGISTRY[t] for t in veomni_hooks.VEOMNI_MODEL_TYPES} == entries
        assert all(entries[t] is not before[t] for t in veomni_hooks.VEOMNI_MODEL_TYPES)
        cross_entropy.install_loss_mapping("vexact")  # what apply_ops_config does for the selection
        assert LOSS_MAPPING["ForCausalLM"] is vexact_causal_lm_loss
        assert LOSS_MAPPING["ForConditionalGeneration"] is vexact_causal_lm_loss
        assert all(t in MODELING_REGISTRY.valid_keys() for t in veomni_hooks.VEOMNI_MISSING_TYPES)
    assert not veomni_hooks.is_installed()
    assert not any(t in MODELING_REGISTRY.valid_keys() for t in veomni_hooks.VEOMNI_MISSING_TYPES)
    assert {t: MODELING_REGISTRY[t] for t in veomni_hooks.VEOMNI_MODEL_TYPES} == before
    assert MODELING_REGISTRY._local_mapping == local
    assert cross_entropy.install_loss_mapping is installer
    assert LOSS_MAPPING.keys() == mapping.keys() and all(LOSS_MAPPING[k] is v for k, v in mapping.items())
    if was:
        veomni_hooks.install()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "deepseek_v3"])
def test_registry_builds_the_shared_model(hooks, tiny_model, arch):
    model = _build(_config(tiny_model, arch))
    assert type(model) is VEOMNI_CLASSES[arch]
    if arch == "deepseek_v3":  # the router's correction bias stays fp32 in a bf16 build (choice only)
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.dtype == torch.float32 and model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16


def test_other_heads_and_types_stay_veomni(hooks, tiny_model):
    from veomni.models.loader import get_model_class

    value_head = get_model_class(_config(tiny_model, "qwen3", ["Qwen3ForTokenClassification"]))
    assert value_head.__module__.startswith("veomni.") and value_head.__name__ == "Qwen3ForTokenClassification"
    moe = AutoConfig.for_model("qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    assert get_model_class(moe).__name__ == "VeOmniVexactQwen3MoeForCausalLM"  # a family of the table
    other = AutoConfig.for_model("gpt_oss", architectures=["GptOssForCausalLM"])
    assert get_model_class(other).__module__.startswith("veomni.")  # not one: VeOmni's own


@pytest.mark.parametrize(
    "model_type,architecture,match",
    [("qwen3_next", "Qwen3NextForCausalLM", "MODELING_BACKEND=hf"),
     ("deepseek_v2", "DeepseekV2ForCausalLM", "MODELING_BACKEND=hf"),
     ("qwen3_5", "Qwen3_5ForConditionalGeneration", "model type 'qwen3_5_text'"),
     ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "model type 'qwen3_5_moe_text'")],
)  # fmt: skip
def test_what_veomni_cannot_build_as_ours_is_refused(hooks, model_type, architecture, match):
    """VeOmni lacks Qwen3-Next and DeepSeek-V2, and builds its own vision-language model for Qwen3.5's
    published checkpoints: each says what to do instead of training a model that is not the rollout's."""
    from veomni.models.loader import get_model_class

    with pytest.raises(ValueError, match=match):
        get_model_class(AutoConfig.for_model(model_type, architectures=[architecture]))


def test_the_hf_backend_builds_ours_where_veomni_has_no_model(hooks, tiny_model, monkeypatch):
    """What the refusal tells users to do works: MODELING_BACKEND=hf builds the vexact class."""
    monkeypatch.setenv("MODELING_BACKEND", "hf")
    from vexact_vllm.model_patches.trainers import transformers_hooks

    with transformers_hooks.installed():
        model = _build(_config(tiny_model, "qwen3_next"))
    assert type(model).__name__ == "VexactQwen3NextForCausalLM"


def test_vexact_loss_kernel_through_veomni_registries(hooks, tiny_model):
    """cross_entropy_loss_implementation=vexact: apply_ops_config installs it in LOSS_MAPPING, the
    model's OpSlot resolves it from KERNEL_REGISTRY, and it gives the same bits as 'eager'."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    config = _config(tiny_model, "qwen3")
    model = _build(config, cross_entropy_loss="eager")
    ids = torch.randint(0, config.vocab_size, (1, 24))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    kwargs = dict(input_ids=ids, position_ids=pos, labels=ids, shift_labels=torch.roll(ids, -1, 1))
    eager = model(**kwargs, return_log_probs=True, temperature=0.7).log_probs
    assert not veomni_causal_lm_loss.use_non_eager_impl

    model = _build(config, cross_entropy_loss="vexact")
    assert veomni_causal_lm_loss.bound_kernel() is vexact_causal_lm_loss
    assert LOSS_MAPPING["ForCausalLM"] is vexact_causal_lm_loss
    assert torch.equal(model(**kwargs, return_log_probs=True, temperature=0.7).log_probs, eager)
    _build(config, cross_entropy_loss="eager")  # leave the process-wide slot as the other tests expect


@pytest.mark.parametrize(
    ("op", "value"),
    [("cross_entropy_loss", "chunk_loss"), ("rms_norm", "triton"), ("rotary_pos_emb", "triton")],
)
def test_selections_the_shared_model_would_ignore_are_refused(hooks, tiny_model, op, value):
    with pytest.raises(ValueError, match=f"{op}_implementation"):
        _build(_config(tiny_model, "qwen3"), **{op: value})
    _build(_config(tiny_model, "qwen3"))  # rebind the slot to eager


def test_sequence_parallel_is_refused(hooks, tiny_model, monkeypatch):
    import veomni.distributed.parallel_state as ps

    class _SP:
        sp_enabled = True
        cp_enabled = False

    monkeypatch.setattr(ps, "is_parallel_state_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_parallel_state", lambda: _SP())
    with pytest.raises(ValueError, match="sequence/context parallelism"):
        VEOMNI_CLASSES["qwen3"]._from_config(_config(tiny_model, "qwen3"))
