"""The one-GPU smoke (examples/verl/smoke_1gpu.sh) on CPU: its generated GSM8K-format data goes through
verl's own dataset class and GSM8K reward, its overrides compose and validate against verl's config
for one GPU, and the verify pair's comparison reads verl's console-logger lines and judges them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.test_verl_recipe import EXAMPLES, VERIFY, compose

pytest.importorskip("verl")
SMOKE = EXAMPLES / "smoke_1gpu.sh"
METRICS = ("training/rollout_probs_diff_max", "rollout_corr/k3_kl")


def _make_data(out: Path, seed: int = 0) -> None:
    subprocess.run([sys.executable, str(EXAMPLES / "synthetic_gsm8k.py"), "--local_save_dir", str(out),
                    "--train_size", "16", "--test_size", "4", "--seed", str(seed)], check=True, capture_output=True)


def test_synthetic_gsm8k_reads_through_verls_dataset_and_reward(tmp_path, tiny_model):
    tiny_model = tiny_model()
    import pandas as pd
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.reward_score import default_compute_score

    _make_data(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    overrides = [f"data.train_files={tmp_path / 'train.parquet'}", "data.max_prompt_length=256",
                 "data.filter_overlong_prompts=True", "data.truncation=error"]
    data_cfg = compose(overrides).data
    dataset = RLHFDataset(str(tmp_path / "train.parquet"), tok, data_cfg)
    assert len(dataset) == 16  # none filtered as overlong at the smoke's max_prompt_length
    frame = pd.read_parquet(tmp_path / "train.parquet")
    row = frame.iloc[3]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    question, answer = row["extra_info"]["question"], row["extra_info"]["answer"]
    assert row["prompt"][0]["content"].startswith(question)
    # verl's GSM8K reward gives the reference solution full marks and a wrong final answer none.
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score("openai/gsm8k", answer, truth) == 1.0
    assert default_compute_score("openai/gsm8k", answer.replace(f"#### {truth}", "#### 1000"), truth) == 0.0
    # The same seed gives the same rows; another seed other rows.
    _make_data(tmp_path / "again")
    assert pd.read_parquet(tmp_path / "again" / "train.parquet").equals(frame)
    _make_data(tmp_path / "other", seed=1)
    assert not pd.read_parquet(tmp_path / "other" / "train.parquet").equals(frame)


@pytest.mark.parametrize("engine", ["fsdp", "veomni"])
def test_smoke_overrides_validate_for_one_gpu(tmp_path, tiny_model, engine):
    tiny_model = tiny_model()
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    env = {**os.environ, "DRY_RUN": "1", "WORK": str(tmp_path), "MODEL_PATH": str(tiny_model),
           "PYTHON": sys.executable, "MODEL_ENGINE": engine}
    subprocess.run(["bash", str(SMOKE)], env=env, check=True, capture_output=True)
    assert (tmp_path / "data" / "train.parquet").is_file()
    for vexact in ("1", "0"):
        cfg = compose((tmp_path / "logs" / f"vexact{vexact}.log").read_text().splitlines())
        assert cfg.trainer.n_gpus_per_node == 1 and cfg.trainer.total_training_steps == 1
        assert cfg.actor_rollout_ref.model.path == str(tiny_model)
        # vLLM's context is the run's lengths, not the checkpoint's positions (a 1.7B shape's 40,960)
        assert cfg.actor_rollout_ref.rollout.max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length
        if engine == "veomni":  # one rank: VeOmni builds without FSDP, so not on the meta device
            assert cfg.actor_rollout_ref.actor.veomni.init_device == cfg.actor_rollout_ref.ref.veomni.init_device == "cuda"
            assert cfg.actor_rollout_ref.ref.veomni.param_offload is False  # offloading needs FSDP
        validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def _log(path: Path, values: dict[str, float]) -> None:
    """A log as verl's console logger writes it behind Ray's prefix, one line a step."""
    from verl.utils.logger.aggregate_logger import concat_dict_to_str

    lines = ["(TaskRunner pid=4242) some start-up line"]
    for step in (1, 2):
        metrics = {"actor/pg_loss": 0.5, **values, "response_length/mean": 128.0}
        lines.append("(TaskRunner pid=4242) " + concat_dict_to_str(metrics, step=step))
    path.write_text("\n".join(lines) + "\n")


def _compare(log_dir: Path) -> subprocess.CompletedProcess:
    """verify_rollout_match.sh with RUNS="": only the comparison of the logs in `log_dir`."""
    return subprocess.run(["bash", str(VERIFY)], env={**os.environ, "RUNS": "", "LOG_DIR": str(log_dir)},
                          capture_output=True, text=True)


@pytest.mark.parametrize("vexact_value,status", [(0.0, 0), (3.0517578125e-05, 1)])
def test_verify_compares_verl_console_logs(tmp_path, vexact_value, status):
    _log(tmp_path / "vexact1.log", dict.fromkeys(METRICS, vexact_value))
    _log(tmp_path / "vexact0.log", dict.fromkeys(METRICS, 0.0123))
    proc = _compare(tmp_path)
    assert proc.returncode == status, proc.stdout + proc.stderr
    table = [line.split() for line in proc.stdout.splitlines() if line.startswith(METRICS)]
    assert [(row[0], row[1]) for row in table] == [(m, s) for m in METRICS for s in ("1", "2")]
    assert all(row[3] == "0.0123" for row in table)
    assert ("PASS" in proc.stdout) == (status == 0)


def test_verify_fails_when_a_metric_is_missing(tmp_path):
    _log(tmp_path / "vexact1.log", {METRICS[0]: 0.0})  # no k3_kl: rollout correction off
    _log(tmp_path / "vexact0.log", dict.fromkeys(METRICS, 0.0123))
    proc = _compare(tmp_path)
    assert proc.returncode == 1 and "rollout_corr/k3_kl: not logged" in proc.stderr


def test_verify_says_which_side_has_not_run(tmp_path):
    _log(tmp_path / "vexact1.log", dict.fromkeys(METRICS, 0.0))  # stock (RUNS=0) not run yet
    proc = _compare(tmp_path)
    assert proc.returncode == 1 and "vexact0.log: run that side (RUNS=0) first" in proc.stderr
    assert "vexact1.log" not in proc.stderr and "PASS" not in proc.stdout
    assert "calculate_log_probs" not in proc.stderr  # the missing side, not a missing metric, is the cause
