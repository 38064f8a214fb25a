"""Pipeline parallelism in one process: each stage's decoder is built alone (its layers under their
global names, placeholders for the rest), loaded from the whole model's tensors by name, and run on
what the stage before handed over; the last stage's output must be `torch.equal` to the unsplit
decoder's, which is what the trainer runs, and every hand-over (hidden states and residual) must be
the unsplit decoder's at that layer boundary. Every family, tied and untied embeddings, even and
uneven partitions (vLLM's own split and explicit ones), 2-4 stages, and stages that are also
tensor-parallel (threads, tests/model_patches/test_tensor_parallel.py's group)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model_patches.test_tensor_parallel import ThreadGroup
from vexact_vllm.model_patches import UnsupportedModelError
from vexact_vllm.model_patches.attention_context import PackedAttention
from vexact_vllm.model_patches.config import DecoderConfig
from vexact_vllm.model_patches.families import BY_MODEL_TYPE, FAMILIES
from vexact_vllm.model_patches.layers import Embedding, pack_projections
from vexact_vllm.model_patches.models import build_decoder
from vexact_vllm.model_patches.pipeline_parallel import (
    HANDED_OVER,
    MissingLayer,
    PipelineStage,
    missing_prefixes,
    pipeline_stages,
)
from vexact_vllm.model_patches.tensor_parallel import shard_of


def _config(model_type: str, rng: random.Random, tp: int = 1) -> DecoderConfig:
    family = BY_MODEL_TYPE[model_type]
    heads = tp * rng.choice([1, 2])
    kv = rng.choice([d for d in (1, 2, heads) if heads % d == 0 and (d % tp == 0 or tp % d == 0)])
    layers = rng.randint(3, 6)
    fields = {**family.tiny, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": rng.choice([8, 16]),
              "hidden_size": rng.choice([24, 40, 64]), "intermediate_size": rng.choice([36, 50]),
              "num_hidden_layers": layers, "vocab_size": rng.choice([61, 96, 130]),
              "tie_word_embeddings": rng.random() < 0.5}  # fmt: skip
    if model_type in ("qwen3_moe", "qwen3_next"):
        fields.update(num_experts=rng.choice([3, 5]), num_experts_per_tok=2, moe_intermediate_size=rng.choice([20, 33]),
                      mlp_only_layers=[rng.randrange(layers)])  # fmt: skip
    if "layer_types" in fields:  # the hybrid families: Gated DeltaNet or full attention, drawn per layer
        fields["layer_types"] = [rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)]
        fields["head_dim"] = 16  # a quarter rotates: an even number of dims
        if "intermediate_size" not in family.tiny:
            del fields["intermediate_size"]
    return DecoderConfig.from_hf(family.hf_config_class()(**fields))


def _partition(num_layers: int, size: int, rng: random.Random) -> list[tuple[int, int]]:
    """vLLM's split (get_pp_indices without VLLM_PP_LAYER_PARTITION), or a random uneven one."""
    if rng.random() < 0.5:
        from vllm.distributed.utils import get_pp_indices

        return [get_pp_indices(num_layers, r, size) for r in range(size)]
    cuts = sorted(rng.sample(range(1, num_layers), size - 1))
    edges = [0, *cuts, num_layers]
    return list(zip(edges, edges[1:]))


def _whole(config: DecoderConfig, seed: int):
    torch.manual_seed(seed)
    model = build_decoder(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return model.to(torch.bfloat16).eval()


def _stage_model(config, stage, state, tp=None):
    """The stage's decoder, its tensors taken from the whole model's as `VllmVexactForCausalLM.load_weights`
    takes them (names under a missing part skipped, every built parameter loaded)."""
    model = build_decoder(config, tp, stage).to(torch.bfloat16).eval()
    pack_projections(model)
    params, skipped = {**dict(model.named_parameters()), **dict(model.named_buffers())}, missing_prefixes(model)
    loaded = set()
    for name, full in state.items():
        if name.startswith(skipped):
            assert name not in params, name
            continue
        params[name].data.copy_(shard_of(params[name], full))
        loaded.add(name)
    assert loaded == set(params), set(params) ^ loaded
    return model


def _inputs(config, rng):
    lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
    ids = torch.randint(0, config.vocab_size, (sum(lens),))
    positions = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, PackedAttention(cu)


def _boundaries(whole, inputs) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The unsplit decoder's output and, after each layer i, its (hidden states, residual)."""
    after = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: after.__setitem__(i, out))
             for i, layer in enumerate(whole.layers)]  # fmt: skip
    try:
        with torch.no_grad():
            out = whole(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return out, after


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("model_type", [f.model_type for f in FAMILIES if f.tiny is not None])
def test_stages_reproduce_the_unsplit_decoder(model_type, seed):
    rng = random.Random(f"{model_type}-{seed}")
    config = _config(model_type, rng)
    size = rng.randint(2, min(4, config.num_layers))
    stages = [
        PipelineStage(r, size, a, b) for r, (a, b) in enumerate(_partition(config.num_layers, size, rng))
    ]
    whole = _whole(config, seed)
    inputs = _inputs(config, rng)
    want, after = _boundaries(whole, inputs)
    state = {k: v.detach() for k, v in whole.state_dict().items()}
    handed_over = None
    for stage in stages:
        model = _stage_model(config, stage, state)
        with torch.no_grad():
            out = model(inputs[0] if stage.is_first else None, *inputs[1:], handed_over)
        if stage.is_last:
            assert torch.equal(out, want), (model_type, seed, stages)
        else:
            x, residual = out
            bx, br = after[stage.stop - 1]
            assert torch.equal(x, bx) and torch.equal(residual, br), (model_type, seed, stage)
            handed_over = (x.clone(), residual.clone())  # what arrives is a copy, as over NCCL


@pytest.mark.parametrize("tie", [True, False])
def test_each_stage_builds_only_its_parts(tie):
    """Names: the built parts keep the unsplit model's names; the embedding lives on the first stage
    and, tied, on the last; norm on the last; every other part is a placeholder with no parameter."""
    config = _config("qwen3", random.Random(0))
    config.tie_word_embeddings = tie
    whole_names = {n for n, _ in build_decoder(config).named_parameters()}
    stages = pipeline_stages(config.num_layers, 2, lambda n, r, s: ((0, 1), (1, n))[r])
    seen = set()
    for stage in stages:
        model = build_decoder(config, stage=stage)
        names = {n for n, _ in model.named_parameters()}
        assert names <= whole_names
        seen |= names
        assert isinstance(model.embed_tokens, Embedding) == (stage.is_first or (tie and stage.is_last))
        assert isinstance(model.norm, MissingLayer) == (not stage.is_last)
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, MissingLayer) == (not stage.owns(i)), (stage, i)
        assert not any(n.startswith(missing_prefixes(model)) for n in names)
    assert seen == whole_names


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_tensor_parallel_stages_reproduce_the_unsplit_decoder(model_type, seed):
    """PP x TP: each stage's T ranks (threads) build their shards of the stage; rank r of stage s + 1
    starts from what rank r of stage s handed over (every rank holds the full [T, H], bit for bit)."""
    rng = random.Random(f"pp-tp-{model_type}-{seed}")
    tp = 2
    config = _config(model_type, rng, tp)
    stages = [PipelineStage(r, 2, a, b) for r, (a, b) in enumerate(_partition(config.num_layers, 2, rng))]
    whole = _whole(config, seed)
    inputs = _inputs(config, rng)
    want, _ = _boundaries(whole, inputs)
    state = {k: v.detach() for k, v in whole.state_dict().items()}
    handed_over = [None] * tp
    for stage in stages:

        def rank(r_tp, stage=stage, handed_over=handed_over):
            model = _stage_model(config, stage, state, r_tp)
            with torch.no_grad():
                return model(inputs[0] if stage.is_first else None, *inputs[1:], handed_over[r_tp.rank])

        handed_over = ThreadGroup(tp).run(rank)
    assert all(torch.equal(out, want) for out in handed_over), (model_type, seed, stages)


def test_stage_bounds_are_vllms():
    """vLLM's split: even, the remainder on the stages before the last; VLLM_PP_LAYER_PARTITION
    overrides it; every layer once, in order."""
    from vllm.distributed.utils import get_pp_indices

    spans = lambda n, s: [(st.start, st.stop) for st in pipeline_stages(n, s, get_pp_indices)]  # noqa: E731
    assert spans(4, 2) == [(0, 2), (2, 4)]
    assert spans(5, 2) == [(0, 3), (3, 5)]
    assert spans(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert [s.is_first for s in pipeline_stages(5, 3, get_pp_indices)] == [True, False, False]
    assert [s.is_last for s in pipeline_stages(5, 3, get_pp_indices)] == [False, False, True]


def test_stage_bounds_follow_the_partition_variable(monkeypatch):
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert [(s.start, s.stop) for s in pipeline_stages(4, 2, get_pp_indices)] == [(0, 1), (1, 4)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "0,4")
    with pytest.raises(UnsupportedModelError, match="no layer"):
        pipeline_stages(4, 2, get_pp_indices)


def test_a_stage_without_layers_is_refused():
    from vllm.distributed.utils import get_pp_indices

    with pytest.raises(
        UnsupportedModelError, match="pipeline-parallel size no larger than num_hidden_layers"
    ):
        pipeline_stages(3, 4, get_pp_indices)


def test_bounds_that_skip_a_layer_are_refused():
    with pytest.raises(UnsupportedModelError, match="once each"):
        pipeline_stages(5, 2, lambda n, r, s: ((0, 2), (3, 5))[r])
    with pytest.raises(UnsupportedModelError, match="once each"):
        pipeline_stages(5, 2, lambda n, r, s: ((0, 3), (3, 4))[r])


def test_handed_over_names_are_vllms_intermediate_tensors():
    """The two tensors every stage sends, by the names the wrapper's IntermediateTensors carry."""
    assert HANDED_OVER == ("hidden_states", "residual")
    with pytest.raises(RuntimeError, match="does not hold this part"):
        MissingLayer()(torch.zeros(1))
