"""The vLLM side of the hybrid families without an engine: the hybrid class's state classmethods are the
Gated DeltaNet layers' layout, the registry serves every hybrid row with it, checkpoint names of the
vision-language checkpoints map onto the decoder, and the engine options these models cannot keep exact
are refused with what to do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vexact_vllm.model_patches.config import DecoderConfig, UnsupportedModelError
from vexact_vllm.model_patches.families import BY_MODEL_TYPE, FAMILIES
from vexact_vllm.model_patches.gated_delta import state_dtypes, state_shapes


def _hf_config():
    family = BY_MODEL_TYPE["qwen3_5_text"]
    return family.hf_config_class()(**family.tiny, vocab_size=448)


def test_hybrid_class_declares_the_layers_state_layout():
    from vexact_vllm.vllm_wrapper import VllmVexactHybridForCausalLM

    hf = _hf_config()
    model = SimpleNamespace(hf_config=hf, dtype=torch.bfloat16)
    vllm_config = SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(tensor_parallel_size=1))
    cls = VllmVexactHybridForCausalLM
    assert cls.is_hybrid and cls.has_inner_state
    linear = DecoderConfig.from_hf(hf).linear
    assert cls.get_mamba_state_shape_from_config(vllm_config) == state_shapes(linear)
    vllm_config.parallel_config.tensor_parallel_size = 2  # a rank's heads: half the channels and value heads
    assert cls.get_mamba_state_shape_from_config(vllm_config) == state_shapes(linear.shard(2))
    assert state_shapes(linear.shard(2))[0][0] * 2 == state_shapes(linear)[0][0]
    assert cls.get_mamba_state_dtype_from_config(vllm_config) == state_dtypes(torch.bfloat16) == (
        (torch.float32,) * 4 + (torch.bfloat16,) * 5)  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="--no-enable-prefix-caching"):
        cls.get_mamba_state_copy_func()


def test_registry_serves_the_hybrid_rows_with_the_hybrid_class():
    hybrid = {f.architecture for f in FAMILIES if f.hybrid}
    assert hybrid == {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                      "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}  # fmt: skip
    assert all(f.vllm_class == ("VllmVexactHybridForCausalLM" if f.hybrid else "VllmVexactForCausalLM") for f in FAMILIES)
    from vexact_vllm.registry import vexact_architectures

    assert vexact_architectures(["Qwen3_5ForCausalLM"]) == ["VllmVexactQwen3_5ForCausalLM"]
    assert vexact_architectures(["VllmVexactQwen3_5ForCausalLM"]) == ["VllmVexactQwen3_5ForCausalLM"]


def test_vision_language_names_map_onto_the_decoder():
    from vexact_vllm.vllm_wrapper import _language_model_name

    assert _language_model_name("model.language_model.layers.0.linear_attn.A_log") == "model.layers.0.linear_attn.A_log"
    assert _language_model_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert _language_model_name("mtp.layers.0.mlp.gate.weight") is None
    assert _language_model_name("lm_head.weight") == "lm_head.weight"


def _engine(prefix_caching=False, conv="auto", ssm="auto"):
    cache = SimpleNamespace(enable_prefix_caching=prefix_caching, mamba_cache_dtype=conv, mamba_ssm_cache_dtype=ssm)
    return (SimpleNamespace(cache_config=cache, model_config=SimpleNamespace(dtype=torch.bfloat16)),)


@pytest.mark.parametrize("options,match", [
    (dict(prefix_caching=True), "--no-enable-prefix-caching"),
    (dict(ssm="bfloat16"), "--mamba-ssm-cache-dtype"), (dict(conv="float32"), "--mamba-cache-dtype"),
])  # fmt: skip
def test_engine_options_are_refused_with_what_to_do(options, match):
    from vexact_vllm.engine_checks import refuse_unsupported_state_cache

    with pytest.raises(UnsupportedModelError, match=match):
        refuse_unsupported_state_cache(*_engine(**options))
    refuse_unsupported_state_cache(*_engine(ssm="float32", conv="bfloat16"))  # the layout's own dtypes pass


def test_hybrids_capture_decode_steps_only():
    """A step with prefill rows reads its row split on the host (design C), so a hybrid's graphs are decode
    steps (FULL_DECODE_ONLY) and its state metadata says so to vLLM; other models keep FULL graphs, and
    graphs off stay off."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    from vexact_vllm.state_cache import VexactStateMetadataBuilder
    from vexact_vllm.vllm_wrapper import _full_cuda_graphs

    for hybrid, mode, want in [(True, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
                               (True, CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY),
                               (False, CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL),
                               (True, CUDAGraphMode.NONE, CUDAGraphMode.NONE)]:  # fmt: skip
        config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))
        _full_cuda_graphs(config, hybrid)
        assert config.compilation_config.cudagraph_mode == want, (hybrid, mode)
    assert VexactStateMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_state_metadata_lives_in_persistent_buffers_and_pads_with_no_slot():
    """What the builder computes goes to the same addresses at every step (a CUDA graph replays the ones
    it captured); a request with no rows (a graph's padding) gets slot -1 and no state."""
    from vexact_vllm.kernels.gated_delta.incremental_cache import split_step
    from vexact_vllm.state_cache import VexactStateMetadataBuilder

    scheduler = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=16)
    builder = VexactStateMetadataBuilder(None, ["l"], SimpleNamespace(scheduler_config=scheduler), "cpu")
    table = torch.tensor([[5, 0], [2, 0], [7, 0], [9, 9]], dtype=torch.int32)
    pointers = None
    steps = [([0, 3, 4, 5, 5], [3, 9, 1, 0], False, True), ([0, 1, 2, 2, 2], [4, 10, 0, 0], True, True),
             ([0, 70, 71, 71, 71], [135, 64, 0, 0], False, False)]  # fmt: skip
    for query, seq, decode, host_lens in steps:
        m = SimpleNamespace(num_reqs=4, num_actual_tokens=query[-1], query_start_loc=torch.tensor(query, dtype=torch.int32),
                            query_start_loc_cpu=torch.tensor(query, dtype=torch.int32),
                            seq_lens=torch.tensor(seq, dtype=torch.int32), block_table_tensor=table,
                            seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32) if host_lens else None,
                            max_query_len=max(b - a for a, b in zip(query, query[1:])))  # fmt: skip
        meta = builder.build(0, m)
        if decode:
            assert meta.split is None
        else:  # the kernels' split from the host lengths (vLLM's seq_lens on the device where it has none)
            want = split_step(m.query_start_loc, meta.context_lens, meta.has_state, torch.device("cpu"))
            for name in ("held", "single"):
                assert torch.equal(getattr(meta.split, name), getattr(want, name)), name
            for name in ("seq", "first", "src", "chunk_start"):
                assert torch.equal(getattr(meta.split.chunks, name), getattr(want.chunks, name)), name
            assert (meta.split.n_single, meta.split.chunks.rows) == (want.n_single, want.chunks.rows)
        lengths = torch.tensor(query[1:]) - torch.tensor(query[:-1])
        want_slots = torch.where(lengths > 0, table[:, 0], -1)
        assert torch.equal(meta.slots, want_slots.to(torch.int32))
        assert torch.equal(meta.context_lens, torch.tensor(seq, dtype=torch.int32) - lengths.to(torch.int32))
        assert torch.equal(meta.has_state, meta.context_lens > 0) and meta.decode_only == decode
        now = [t.data_ptr() for t in (meta.slots, meta.context_lens, meta.has_state)]
        assert pointers is None or now == pointers
        pointers = now
