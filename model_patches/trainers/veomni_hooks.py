"""VeOmni side of the training switch: VeOmni builds and scores the families of the table with the
shared model. Symmetric and idempotent: `install()`, `uninstall()`, `is_installed()` and the
`installed()` context manager. The patches are rows of `PATCHES` (vexact_vllm.patching: checked
against VeOmni's signatures at install, undone by `uninstall()`):

1. Modeling registry (`veomni.models.loader.MODELING_REGISTRY`, read by `build_foundation_model`
   through `get_model_class`): a local override per supported model type VeOmni registers
   (`VEOMNI_MODEL_TYPES`: every family but DeepSeek-V2 and Qwen3-Next, which VeOmni does not register, and
   the vision-language rows of Qwen3.5, whose VeOmni class is its vision-language model; their text rows
   `qwen3_5_text` and `qwen3_5_moe_text` are served) returns the vexact class
   of `veomni_classes` wherever VeOmni's own entry would return its `*ForCausalLM`; other heads of
   these types (the value model's `ForTokenClassification`, `ForSequenceClassification`) and every
   other model type stay VeOmni's. Under `MODELING_BACKEND=hf` VeOmni skips this registry and asks
   transformers' `AutoModelForCausalLM`, which `transformers_hooks.install()` already points at the
   vexact training classes. Refused with what to do, in the same registry: the vision-language
   architecture of Qwen3.5's rows (VeOmni's entry would build its own model) and the model types VeOmni
   lacks (an entry `install()` writes and `uninstall()` removes; MODELING_BACKEND=hf builds them as ours).
2. Kernel registry (`veomni.ops.kernel_registry.KERNEL_REGISTRY`): `vexact_causal_lm_loss` under the
   name "vexact" for the `cross_entropy_loss` op (causal; seq_cls maps to VeOmni's eager
   wrapper, as its chunk_loss does), so `cross_entropy_loss_implementation=vexact` binds it into
   the OpSlot VeOmni resolves when it builds a model.
3. Loss mapping (`veomni.ops.kernels.cross_entropy.install_loss_mapping`, which `apply_ops_config`
   calls with that same selection): "vexact" installs `vexact_causal_lm_loss` as transformers'
   `LOSS_MAPPING["ForCausalLM"]` (and "ForConditionalGeneration", and VeOmni's eager
   sequence-classification loss), written through `PATCHES.set_item`, so `uninstall()` puts back
   what was there before (an entry VeOmni wrote later stays); every other name goes to VeOmni's
   function unchanged.

Step 2 is a registration, not a patch: VeOmni's kernel registry has no removal, so the "vexact"
kernel stays registered after `uninstall()` (inert until a config selects it).

VeOmni's log-prob path (`ForCausalLMLoss(return_log_probs=True)` -> `chunk_logprobs_function`, which
divides bf16 logits by the temperature before its fp32 cast) is not patched globally: a vexact
model never reaches it (its forward calls `vexact_causal_lm_loss`), and other models keep it.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from vexact_vllm.patching import Patch, PatchError, PatchTable

from ..families import BY_MODEL_TYPE, FAMILIES
from .veomni_classes import VEOMNI_CLASSES, VEXACT_KERNEL_NAME, vexact_causal_lm_loss

# What VeOmni's registry entries attach to its own classes for loading (Qwen3-MoE: the converter that
# stacks per-expert checkpoint tensors into gate_up_proj/down_proj, and its index mapping): our
# class needs the same, or VeOmni's loader skips those tensors.
_LOADING_HOOKS = ("_create_checkpoint_tensor_converter", "_convert_fqn_to_index_mapping",
                  "_convert_lora_targets_to_parameters")  # fmt: skip


def _modeling_entry(model_type: str, veomni_entry):
    """VeOmni's registry entry for `model_type`, with its causal-LM class replaced by ours (which
    takes over the loading hooks VeOmni gave its own)."""

    def build(architecture):
        cls = veomni_entry(architecture)
        if not cls.__name__.endswith("ForCausalLM"):
            return cls
        ours = VEOMNI_CLASSES[model_type]
        for name in _LOADING_HOOKS:
            if name in vars(cls):
                setattr(ours, name, vars(cls)[name])
        return ours

    build.vexact_model_type = model_type
    return build


def _refusing_entry(model_type: str, veomni_entry=None):
    """A registry entry for a family VeOmni cannot build as ours: its architecture raises a ValueError that
    says what to do; other heads go to VeOmni's own entry (veomni_entry, None where VeOmni has none)."""
    family = BY_MODEL_TYPE[model_type]

    def build(architecture):
        if veomni_entry is None:
            raise ValueError(
                f"VeOmni has no model for model type {model_type!r} ({architecture}); set MODELING_BACKEND=hf: "
                "VeOmni then builds it through transformers' AutoModelForCausalLM, which vexact-vllm points at "
                "its own class"
            )
        if architecture == family.architecture:
            raise ValueError(
                f"VeOmni builds its own vision-language model for {architecture} checkpoints (model type "
                f"{model_type!r}), not vexact-vllm's, which serves their text model only: train from the text "
                f"model's config (model type {model_type + '_text'!r}), which VeOmni builds as vexact-vllm's class"
            )
        return veomni_entry(architecture)

    build.vexact_model_type = model_type
    return build


def _seq_cls_loss():
    from veomni.ops.kernels.cross_entropy import ForSequenceClassificationLoss
    from veomni.ops.kernels.cross_entropy.eager import eager_cross_entropy

    return partial(ForSequenceClassificationLoss, cross_entropy_fn=eager_cross_entropy)


def _register_kernels() -> None:
    """Once per process (VeOmni's kernel registry has no removal; the name is inert until selected)."""
    from veomni.ops.kernel_registry import KERNEL_REGISTRY, HardwareRequirement, KernelSpec

    factories = {"causal": lambda: vexact_causal_lm_loss, "seq_cls": _seq_cls_loss}
    for variant, factory in factories.items():
        if VEXACT_KERNEL_NAME in KERNEL_REGISTRY.list_available("cross_entropy_loss", variant):
            continue
        KERNEL_REGISTRY.register(
            KernelSpec(
                name=VEXACT_KERNEL_NAME,
                op_name="cross_entropy_loss",
                variant=variant,
                factory=factory,
                hardware=HardwareRequirement(device_type="any"),
                description="vexact-vllm: the rollout's log-prob function (fused lm_head, fp32, one temperature)",
            )
        )


def _loss_mapping_installer(veomni_install):
    def install_loss_mapping(impl: str = "eager") -> str:
        if impl != VEXACT_KERNEL_NAME:
            return veomni_install(impl)
        from transformers.loss.loss_utils import LOSS_MAPPING

        PATCHES.set_item(LOSS_MAPPING, "ForCausalLM", vexact_causal_lm_loss)  # undone by uninstall()
        PATCHES.set_item(LOSS_MAPPING, "ForConditionalGeneration", vexact_causal_lm_loss)
        PATCHES.set_item(LOSS_MAPPING, "ForSequenceClassification", _seq_cls_loss())
        return f"CrossEntropy ({VEXACT_KERNEL_NAME})"

    return install_loss_mapping


WRITTEN_FOR = "VeOmni 0.1.12"
# The families whose model type VeOmni's modeling registry has (DeepSeek-V2 has no VeOmni model: VeOmni
# builds it through transformers, MODELING_BACKEND=hf, where transformers_hooks gives it ours).
VEOMNI_MODEL_TYPES = tuple(f.model_type for f in FAMILIES if f.veomni)
# The vision-language rows (Qwen3.5's): VeOmni's entry builds its vision-language model, which is not
# ours; that architecture is refused with what to do (`_refusing_entry`).
VEOMNI_VISION_TYPES = tuple(f.model_type for f in FAMILIES if not f.veomni and f.text_config)
# The families VeOmni's registry lacks (DeepSeek-V2, Qwen3-Next): install() writes an entry that refuses
# with what to do, uninstall() removes it.
VEOMNI_MISSING_TYPES = tuple(f.model_type for f in FAMILIES if not f.veomni and not f.text_config)

# The whole patch set, one row per target (vexact_vllm.patching).
PATCHES = PatchTable(
    "veomni",
    (
        *(
            Patch(f"veomni.models.loader:MODELING_REGISTRY[{model_type}]", partial(_modeling_entry, model_type),
                  ("architecture",), WRITTEN_FOR)
            for model_type in VEOMNI_MODEL_TYPES
        ),
        *(
            Patch(f"veomni.models.loader:MODELING_REGISTRY[{model_type}]", partial(_refusing_entry, model_type),
                  ("architecture",), WRITTEN_FOR)
            for model_type in VEOMNI_VISION_TYPES
        ),
        Patch("veomni.ops.kernels.cross_entropy:install_loss_mapping", _loss_mapping_installer, ("impl",),
              WRITTEN_FOR),
    ),
)  # fmt: skip


def install() -> None:
    if not PATCHES.is_installed():
        _register_kernels()
    PATCHES.install()
    from veomni.models.loader import MODELING_REGISTRY

    for model_type in VEOMNI_MISSING_TYPES:
        if model_type not in MODELING_REGISTRY.valid_keys():
            PATCHES.set_item(MODELING_REGISTRY, model_type, _refusing_entry(model_type))
        elif getattr(MODELING_REGISTRY[model_type], "vexact_model_type", None) is None:
            raise PatchError(f"VeOmni now registers {model_type!r}: add its family to VeOmni's rows (families.py)")


uninstall = PATCHES.uninstall  # VeOmni's registry entries, its installer and the LOSS_MAPPING entries
is_installed = PATCHES.is_installed


@contextmanager
def installed():
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
