"""The verl recipe's overrides compose against verl's own ppo_trainer config, so a misspelt or stale key
fails here, not on a GPU cluster: each script is run with DRY_RUN=1 (it prints its overrides, one a
line), and the lines go to Hydra's `compose` with verl's config directory, as `python -m
verl.trainer.main_ppo` would; then verl's config dataclasses are built from the result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "verl"
RECIPE = EXAMPLES / "run_qwen3_grpo_gsm8k.sh"
VERIFY = EXAMPLES / "verify_rollout_match.sh"


def _env(**env: str) -> dict[str, str]:
    """A dry run's environment; $PYTHON (with which the recipe reads the model's prefix-caching default)
    is this interpreter."""
    return {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, **env}


def _overrides(script: Path, *args: str, **env: str) -> list[str]:
    out = subprocess.run(
        ["bash", str(script), *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def compose(overrides: list[str]):
    verl = pytest.importorskip("verl")
    hydra = pytest.importorskip("hydra")
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with hydra.initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra.compose(config_name="ppo_trainer", overrides=overrides)


@pytest.mark.parametrize("engine,strategy", [("fsdp", "fsdp"), ("veomni", "veomni")])
@pytest.mark.parametrize("vexact", ["1", "0"])
def test_recipe_composes_with_verl_config(vexact, engine, strategy):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg = compose(_overrides(RECIPE, VEXACT=vexact, MODEL_ENGINE=engine))
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.name == "vllm"
    assert rollout.engine_kwargs.vllm.get("model_impl") == ("vexact" if vexact == "1" else None)
    assert rollout.calculate_log_probs is True and rollout.tensor_model_parallel_size == 1
    assert cfg.actor_rollout_ref.model.external_lib == "vexact_vllm.model_patches.enable"
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False  # what the GPU smoke ran with
    assert cfg.model_engine == ("dp" if engine == "fsdp" else "veomni")
    assert cfg.actor_rollout_ref.actor.strategy == strategy
    correction = cfg.algorithm.rollout_correction  # decoupled: verl logs rollout_corr/k3_kl
    assert correction.bypass_mode is False and correction.rollout_is is None
    assert cfg.algorithm.adv_estimator == "grpo"
    # verl's own checks accept the result: main_ppo's validate_config (batch sizes against the GPU
    # count, micro-batch settings, the actor dataclass) and the rollout/algorithm dataclasses.
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    omega_conf_to_dataclass(rollout)
    omega_conf_to_dataclass(cfg.algorithm)


def test_verify_pair_differs_only_in_the_rollout_implementation(tmp_path):
    _overrides(VERIFY, LOG_DIR=str(tmp_path), STEPS="3")
    runs = {v: (tmp_path / f"vexact{v}.log").read_text().splitlines() for v in ("1", "0")}
    lines = {v: {line for line in run if not line.startswith("trainer.experiment_name=")} for v, run in runs.items()}
    assert lines["1"] - lines["0"] == {"+actor_rollout_ref.rollout.engine_kwargs.vllm.model_impl=vexact"}
    assert lines["0"] <= lines["1"]
    for overrides in runs.values():
        cfg = compose(overrides)
        assert cfg.trainer.total_training_steps == 3 and cfg.trainer.logger == ["console"]


def test_misspelt_key_fails():
    """The harness itself: Hydra refuses a key verl's config does not have."""
    from hydra.errors import ConfigCompositionException

    overrides = _overrides(RECIPE) + ["actor_rollout_ref.rollout.calculate_log_prob=True"]
    with pytest.raises(ConfigCompositionException):
        compose(overrides)


def test_bad_choices_are_refused():
    for env in ({"VEXACT": "yes"}, {"MODEL_ENGINE": "megatron"}):
        proc = subprocess.run(["bash", str(RECIPE)], env=_env(**env), capture_output=True)
        assert proc.returncode == 1 and proc.stdout == b""


def test_rollout_tp_reaches_verl_and_its_checks_accept_it():
    """ROLLOUT_TP=2 on two GPUs: verl's rollout tensor_model_parallel_size, accepted by verl's checks."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg = compose(_overrides(RECIPE, ROLLOUT_TP="2", NGPUS_PER_NODE="2"))
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.tensor_model_parallel_size == 2 and cfg.trainer.n_gpus_per_node == 2
    assert rollout.engine_kwargs.vllm.get("model_impl") == "vexact"
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    omega_conf_to_dataclass(rollout)


def test_rollout_pp_reaches_verl_and_the_hooks_accept_it():
    """ROLLOUT_PP=2 on two GPUs: verl's rollout pipeline_model_parallel_size, the training side on at
    `import verl` in every Ray process; verl refuses the rollout config alone, the training side's
    hooks accept it and pass the size to the vLLM server's arguments."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from vexact_vllm.model_patches.trainers import verl_hooks

    cfg = compose(_overrides(RECIPE, ROLLOUT_PP="2", NGPUS_PER_NODE="2"))
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.pipeline_model_parallel_size == 2 and rollout.tensor_model_parallel_size == 1
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == cfg.actor_rollout_ref.model.external_lib
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert not verl_hooks.is_installed()
    with pytest.raises(Exception, match="pipeline_model_parallel_size > 1"):
        omega_conf_to_dataclass(rollout)
    with verl_hooks.installed():
        assert omega_conf_to_dataclass(rollout).engine_kwargs["vllm"]["pipeline_parallel_size"] == 2


def test_rollout_pp_is_vexact_only(tmp_path):
    """Stock vLLM with ROLLOUT_PP > 1 is refused by the recipe; the verify pair runs its stock side at 1."""
    proc = subprocess.run(["bash", str(RECIPE)], env=_env(VEXACT="0", ROLLOUT_PP="2"),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "needs VEXACT=1" in proc.stderr
    _overrides(VERIFY, LOG_DIR=str(tmp_path), ROLLOUT_PP="2")
    runs = {v: (tmp_path / f"vexact{v}.log").read_text().splitlines() for v in ("1", "0")}
    assert "actor_rollout_ref.rollout.pipeline_model_parallel_size=2" in runs["1"]
    assert "actor_rollout_ref.rollout.pipeline_model_parallel_size=1" in runs["0"]
    assert not any("VERL_USE_EXTERNAL_MODULES" in line for line in runs["0"])
    compose(runs["1"])
    compose(runs["0"])


def test_prefix_caching_follows_the_model():
    """Prefix caching stays on (verl's default) for a dense checkpoint and is off for a Gated DeltaNet one
    (vexact refuses it for those families); PREFIX_CACHING overrides the default."""
    from vexact_vllm.tiny_model import builtin_model

    key = "actor_rollout_ref.rollout.enable_prefix_caching="
    for model, want in (("tiny-qwen3", True), ("tiny-qwen3.5", False)):
        overrides = _overrides(RECIPE, MODEL_PATH=builtin_model(model))
        assert key + str(want) in overrides
        assert compose(overrides).actor_rollout_ref.rollout.enable_prefix_caching is want
    assert key + "False" in _overrides(RECIPE, MODEL_PATH=builtin_model("tiny-qwen3"), PREFIX_CACHING="False")
