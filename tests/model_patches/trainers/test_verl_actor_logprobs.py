"""verl's own actor log-prob path on the shared model equals what vLLM returned, bit for bit.

The path is verl 0.9.1's FSDP engine (`FSDPEngineWithLMHead`): its `__init__`, its model build
(`_build_module`: AutoModelForCausalLM with the vexact classes registered), and `infer_batch` /
`forward_backward_batch` on verl's no-padding TensorDict, with `verl_hooks` installed; the FSDP2
wrap itself cannot run on a CPU-only torch (see verl_engine.py for exactly what fails and what is
patched). Contract checks are torch.equal only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")
sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from logprob_reference import assert_recorded_gradients, record_ppo_outputs  # noqa: E402
from verl_engine import build_engine, cpu_verl, response_outputs, rollout_batch  # noqa: E402

from vexact_vllm.model_patches import VexactForCausalLM, enabled  # noqa: E402
from vexact_vllm.model_patches.families import BY_MODEL_TYPE  # noqa: E402
from vexact_vllm.model_patches.trainers import hf_causal_lm, transformers_hooks, verl_hooks  # noqa: E402

TEMPERATURES = (1.0, 0.7)


@pytest.fixture
def hooks(monkeypatch):
    """The training switch on (the verl hooks among its parts), verl on CPU; restored after."""
    cpu_verl(monkeypatch)
    with enabled():
        yield


@pytest.fixture
def unmasked(monkeypatch):
    """The `vllm_rollouts` fixture ran vLLM without verl's compute_logits patch, so it normalised
    over the whole vocabulary: the trainer must not mask either."""
    monkeypatch.setattr(verl_hooks, "rollout_vocab_mask", lambda *args, **kwargs: None)


def _verl_log_probs(engine, rollouts, temperature, **flags):
    data = rollout_batch(rollouts, temperature, engine.model_config.tokenizer.pad_token_id, **flags)
    return response_outputs(engine.infer_batch(data), data)


def _assert_equal_to_rollouts(outputs, rollouts):
    for i, r in enumerate(rollouts):
        got = outputs["log_probs"][i, : len(r.output_ids)]
        assert torch.equal(got, torch.tensor(r.logprobs, dtype=torch.float32)), (i, got, r.logprobs)


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_verl_actor_log_probs_equal_vllm(hooks, unmasked, vllm_rollouts, tiny_model, temperature, use_remove_padding):
    engine = build_engine(tiny_model("qwen3"), use_remove_padding=use_remove_padding)
    assert isinstance(engine.module, VexactForCausalLM)  # built by verl through AutoModelForCausalLM
    rollouts = vllm_rollouts[temperature]
    outputs = _verl_log_probs(engine, rollouts, temperature, use_remove_padding=use_remove_padding)
    _assert_equal_to_rollouts(outputs, rollouts)
    entropy = outputs["entropy"]
    assert torch.isfinite(entropy).all() and bool((entropy[:, 0] > 0).all())


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize(("arch", "tp"), [("qwen3", 1), ("qwen3_moe", 2), ("deepseek_v3", 1), ("qwen3_5_text", 1)])
def test_verl_masked_vocabulary_equals_masked_rollout(hooks, masked_rollouts_of, tiny_model, temperature, arch, tp):
    """vLLM under verl's compute_logits mask (ids >= len(tokenizer) at -inf) vs verl's trainer with
    the mask it builds from its own tokenizer: equal (dense, MoE, DeepSeek-V3's MLA and Qwen3.5's Gated
    DeltaNet hybrid; vLLM unsharded or at
    tensor-parallel size 2, as verl's `rollout.tensor_model_parallel_size=2` starts it, against the
    unsharded trainer); without the mask: not equal."""
    engine = build_engine(tiny_model(arch))
    assert type(engine.module).__name__ == f"Vexact{BY_MODEL_TYPE[arch].architecture}"
    tokenizer_len, vocab = len(engine.model_config.tokenizer), engine.module.config.vocab_size
    assert tokenizer_len < vocab  # the tiny model has vocabulary rows past its tokenizer
    rollouts = masked_rollouts_of(arch, tp)[temperature]
    _assert_equal_to_rollouts(_verl_log_probs(engine, rollouts, temperature), rollouts)
    mask = verl_hooks.rollout_vocab_mask(engine.model_config, vocab, torch.device("cpu"))
    assert int(mask.sum()) == tokenizer_len
    engine._vexact_vocab_mask = None  # what the trainer would compute without the mask
    unmasked = _verl_log_probs(engine, rollouts, temperature)["log_probs"]
    assert not torch.equal(unmasked[0, : len(rollouts[0].logprobs)], torch.tensor(rollouts[0].logprobs))


def _loss(model_output, data, dp_group=None):
    """verl's loss-function signature; a policy-gradient-like loss plus an entropy bonus."""
    log_probs, entropy = model_output["log_probs"].values(), model_output["entropy"].values()
    loss = -(log_probs * 0.5).mean() - 0.01 * entropy.mean()
    return loss, {"loss": loss.detach().item()}


def test_gradient_flows_through_the_shared_log_prob(hooks, unmasked, vllm_rollouts, tiny_model, monkeypatch):
    """verl's forward_backward_batch with `_loss` (temperature 0.7): each micro-batch's loss asks
    -0.5/N of each of its N packed tokens' log-probs and -0.01/N of their entropies (verl's model
    output covers every token, prompt and response), and the gradients the PPO op returns for the
    hidden states and the lm_head equal the fp64 reference's for that upstream
    (logprob_reference.py: within bf16 rounding; the entropy's share, weighted 0.01, is below that
    rounding, so test_ppo_outputs pins the entropy backward). The gradient reaches the decoder."""
    calls = record_ppo_outputs(monkeypatch, hf_causal_lm)
    engine = build_engine(tiny_model("qwen3"), forward_only=False)
    model = engine.module
    model.train()
    rollouts = vllm_rollouts[0.7]
    data = rollout_batch(rollouts, 0.7, engine.model_config.tokenizer.pad_token_id)
    engine.forward_backward_batch(data, _loss, forward_only=False)  # verl calls loss.backward()
    for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None, name
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert len(calls) == -(-len(rollouts) // 2)  # one op call per micro-batch of 2
    for i, call in enumerate(calls):
        assert call["vocab_mask"] is None and call["temperature"] == 0.7
        n = call["hidden"].shape[0]
        torch.testing.assert_close(call["upstream_log_p"], torch.full((n,), -0.5 / n), rtol=1e-6, atol=0)
        torch.testing.assert_close(call["upstream_entropy"], torch.full((n,), -0.01 / n), rtol=1e-6, atol=0)
        assert_recorded_gradients(call, f"micro-batch {i}")
    assert sum(c["hidden"].shape[0] for c in calls) == sum(len(r.prompt_ids) + len(r.output_ids) for r in rollouts)


def test_verl_divides_nothing(hooks, unmasked, vllm_rollouts, tiny_model, monkeypatch):
    """For vexact models verl's own temperature scaling and log-softmax are never called."""
    import verl.workers.engine.fsdp.transformer_impl as impl

    def refuse(*args, **kwargs):
        raise AssertionError("verl's own logits path ran for a vexact model")

    monkeypatch.setattr(impl, "_scale_logits_by_temperature", refuse)
    monkeypatch.setattr(impl, "logprobs_from_logits", refuse)
    engine = build_engine(tiny_model("qwen3"))
    _assert_equal_to_rollouts(_verl_log_probs(engine, vllm_rollouts[0.7], 0.7), vllm_rollouts[0.7])


def test_stock_model_untouched(hooks, vllm_rollouts, tiny_model):
    """A stock transformers model (vexact classes not registered) takes verl's own path, hooks or not."""
    transformers_hooks.uninstall()
    engine = build_engine(tiny_model("qwen3"), override_config={"attn_implementation": "sdpa"})  # no flash-attn on CPU
    assert not isinstance(engine.module, VexactForCausalLM)
    rollouts = vllm_rollouts[1.0]
    with_hooks = _verl_log_probs(engine, rollouts, 1.0)
    verl_hooks.uninstall()
    without = _verl_log_probs(engine, rollouts, 1.0)
    verl_hooks.install()
    assert torch.equal(with_hooks["log_probs"], without["log_probs"])
    assert torch.equal(with_hooks["entropy"], without["entropy"])


def test_refusals(hooks, vllm_rollouts, tiny_model):
    engine = build_engine(tiny_model("qwen3"))
    pad = engine.model_config.tokenizer.pad_token_id
    rollouts = vllm_rollouts[1.0]
    with pytest.raises(ValueError, match="calculate_sum_pi_squared"):
        engine.infer_batch(rollout_batch(rollouts, 1.0, pad, calculate_sum_pi_squared=True))
    with pytest.raises(ValueError, match="distillation"):
        engine.infer_batch(rollout_batch(rollouts, 1.0, pad, distillation_use_topk=True))
    with pytest.raises(ValueError, match="temperature"):
        engine.infer_batch(rollout_batch(rollouts, torch.full((len(rollouts),), 0.7), pad))
    engine.use_ulysses_sp = True
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size=1"):
        engine.infer_batch(rollout_batch(rollouts, 1.0, pad))


def test_install_is_idempotent_and_reversible():
    from verl.models.transformers import monkey_patch
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    was = verl_hooks.is_installed()
    verl_hooks.uninstall()
    original = FSDPEngineWithLMHead.__dict__["prepare_model_inputs"]
    original_patch = monkey_patch.patch_forward_with_backends
    verl_hooks.install()
    verl_hooks.install()
    assert FSDPEngineWithLMHead.__dict__["prepare_model_inputs"].__wrapped__ is original
    assert monkey_patch.patch_forward_with_backends.__wrapped__ is original_patch
    verl_hooks.uninstall()
    assert FSDPEngineWithLMHead.__dict__["prepare_model_inputs"] is original
    assert monkey_patch.patch_forward_with_backends is original_patch
    if was:
        verl_hooks.install()


def test_fused_kernel_flag_keeps_the_vexact_forward(hooks, tiny_model):
    """With verl's use_fused_kernels=True, apply_monkey_patch would swap verl's fused forward onto
    the model class; vexact classes keep theirs."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    engine = build_engine(tiny_model("qwen3"))
    forward = type(engine.module).forward
    apply_monkey_patch(engine.module, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
    assert type(engine.module).forward is forward
