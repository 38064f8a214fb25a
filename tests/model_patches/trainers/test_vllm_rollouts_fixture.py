"""The trainer tests compare against these rollouts: they must be real vLLM output."""

from vexact_vllm.cli.score import load_trainer, trainer_log_probs


def test_rollouts_match_the_shared_model(vllm_rollouts, tiny_model):
    import torch

    trainer = load_trainer(tiny_model("qwen3"), torch.bfloat16, torch.device("cpu"))
    for temperature, rollouts in vllm_rollouts.items():
        assert len(rollouts) == 4 and all(len(r.output_ids) == 12 for r in rollouts)
        scored = trainer_log_probs(trainer, rollouts, 0, temperature)
        for r, s in zip(rollouts, scored):
            assert torch.equal(torch.tensor(r.logprobs, dtype=torch.float32), s)
    assert vllm_rollouts[1.0][0].output_ids != vllm_rollouts[0.7][0].output_ids or \
        vllm_rollouts[1.0][0].logprobs != vllm_rollouts[0.7][0].logprobs
