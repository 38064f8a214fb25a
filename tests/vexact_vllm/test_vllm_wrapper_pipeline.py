"""The vLLM model class as one pipeline stage (built in this process, the stage given): it builds
only its part, takes exactly its tensors from a whole checkpoint and from weight-sync buckets (partial,
in any order, other stages' tensors among them), and still refuses tensors no stage holds. The
engine-level runs (two worker processes) are tests/e2e/test_pipeline_parallel.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vexact_vllm import MODEL_IMPL
from vexact_vllm.model_patches.pipeline_parallel import HANDED_OVER, MissingLayer, PipelineStage

pytestmark = pytest.mark.vllm

# (family, stage bounds of its 4 layers): uneven partitions, tied (qwen3, qwen2) and untied (llama, MoE)
CASES = [("qwen3", ((0, 1), (1, 4))), ("qwen2", ((0, 3), (3, 4))), ("llama", ((0, 2), (2, 4))),
         ("qwen3_moe", ((0, 1), (1, 3), (3, 4)))]  # fmt: skip


@pytest.fixture(scope="module")
def build_stage():
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    import vexact_vllm
    from vexact_vllm import vllm_wrapper

    vexact_vllm.register()

    def build(path: str, stage: PipelineStage):
        cfg = EngineArgs(model=path, model_impl=MODEL_IMPL, block_size=32).create_engine_config()
        old, original = torch.get_default_dtype(), vllm_wrapper.pipeline_stage
        torch.set_default_dtype(torch.bfloat16)
        vllm_wrapper.pipeline_stage = lambda num_layers: stage  # this worker's stage, as vLLM's group would give
        try:
            with set_current_vllm_config(cfg):
                return vllm_wrapper.VllmVexactForCausalLM(vllm_config=cfg)
        finally:
            vllm_wrapper.pipeline_stage = original
            torch.set_default_dtype(old)

    return build


def _stages(bounds) -> list[PipelineStage]:
    return [PipelineStage(r, len(bounds), a, b) for r, (a, b) in enumerate(bounds)]


def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.mark.parametrize(("arch", "bounds"), CASES)
def test_every_stage_loads_its_part_of_a_whole_checkpoint(build_stage, tiny_model, arch, bounds):
    from vexact_vllm.cli.score import load_trainer

    path = tiny_model(arch)
    tensors = _checkpoint(path)
    trainer = load_trainer(path, torch.bfloat16, torch.device("cpu"))
    train_params = dict(trainer.named_parameters())
    covered = set()
    for stage in _stages(bounds):
        model = build_stage(path, stage)
        params = dict(model.named_parameters())
        assert model.load_weights(tensors.items()) == set(params), stage
        for name, param in params.items():
            assert torch.equal(param, train_params[name]), (stage, name)
        covered |= set(params)
        layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
        assert layers == set(range(stage.start, stage.stop)), stage
        assert [not isinstance(a, MissingLayer) for a in model.attn] == [stage.owns(i) for i in range(4)]
        if stage.is_last:  # the lm_head (tied: the embedding, loaded on this stage too)
            assert torch.equal(model.lm_head_weight, trainer.lm_head.weight)
        else:
            with pytest.raises(RuntimeError, match="holds no lm_head"):
                model.lm_head_weight  # noqa: B018
    assert covered == set(train_params) - ({"lm_head.weight"} if trainer.config.tie_word_embeddings else set())


@pytest.mark.parametrize(("arch", "bounds"), [CASES[0], CASES[3]])
def test_weight_sync_buckets_in_any_order(build_stage, tiny_model, arch, bounds):
    """verl's sync sends every worker all tensors, in buckets: each stage takes its own, once every
    bucket arrived every parameter holds the new value, and a bucket of other stages' tensors changes
    nothing."""
    path = tiny_model(arch)
    tensors = _checkpoint(path)
    new = {name: t + 1 for name, t in tensors.items()}  # perturbed, as after an optimizer step
    rng = random.Random(arch)
    for stage in _stages(bounds):
        model = build_stage(path, stage)
        model.load_weights(tensors.items())
        params = dict(model.named_parameters())
        names = sorted(new)
        rng.shuffle(names)
        cuts = sorted(rng.sample(range(1, len(names)), 4))
        loaded = set()
        for a, b in zip([0, *cuts], [*cuts, len(names)]):
            loaded |= model.load_weights((n, new[n]) for n in names[a:b])
        # a stacked expert parameter counts as loaded only when all its experts came in one call
        stacked = {n for n in params if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
        assert loaded <= set(params) and set(params) - loaded <= stacked, stage
        for name, param in params.items():
            assert torch.equal(param, _expected(name, new, param)), (stage, name)
        before = {n: p.clone() for n, p in params.items()}
        other = next(i for i in range(4) if not stage.owns(i))  # a layer another stage holds
        assert model.load_weights((n, t) for n, t in tensors.items() if n.startswith(f"model.layers.{other}.")) == set()
        assert all(torch.equal(p, before[n]) for n, p in params.items())


def _expected(name: str, tensors: dict, param: torch.Tensor) -> torch.Tensor:
    """A parameter's value from per-expert or plain tensors."""
    if name in tensors:
        return tensors[name]
    from vexact_vllm.model_patches.moe import expert_rows, expert_tensor

    want = torch.empty_like(param)
    for n, t in tensors.items():
        target = expert_tensor(n)
        if target is not None and target[0] == name:
            expert_rows(want, target[1], target[2]).copy_(t)
    return want


def test_tensors_no_stage_holds_are_still_refused(build_stage, tiny_model):
    from vexact_vllm.model_patches.config import UnsupportedModelError

    path = tiny_model("qwen3")
    model = build_stage(path, PipelineStage(0, 2, 0, 2))
    good = _checkpoint(path)["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(UnsupportedModelError, match="does not belong"):
        model.load_weights([("model.layers.0.self_attn.qkv_proj.weight", good)])
    with pytest.raises(UnsupportedModelError, match="does not belong"):
        model.load_weights([("model.layer.3.self_attn.q_proj.weight", good)])


def test_stages_meet_vllms_pipeline_contract(build_stage, tiny_model):
    """vLLM's SupportsPP: the class says so and takes intermediate tensors; a stage's buffers are
    the hidden states and the residual, [tokens, H] each."""
    from vllm.model_executor.models.interfaces import supports_pp

    from vexact_vllm.vllm_wrapper import VllmVexactForCausalLM

    assert supports_pp(VllmVexactForCausalLM)
    model = build_stage(tiny_model("qwen3"), PipelineStage(1, 2, 2, 4))
    empty = model.make_empty_intermediate_tensors(7, torch.bfloat16, torch.device("cpu"))
    assert tuple(empty.tensors) == HANDED_OVER
    assert all(t.shape == (7, 128) and t.dtype == torch.bfloat16 for t in empty.tensors.values())
    assert model.model.embed_tokens.weight.shape == (model.config.vocab_size, 128)  # tied: the last stage's lm_head
