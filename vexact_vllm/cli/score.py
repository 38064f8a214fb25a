"""Recompute every generated token with the training class and compare bit for bit.

The training side is the real one: `AutoModelForCausalLM.from_pretrained` with the vexact training
classes enabled, sequences (prompt + generated tokens) packed back to back into micro-batches of
several sizes, log-probs from `packed_log_probs` (the fused lm_head + log-prob function).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .records import Comparison, Mismatch, Rollout


def trainer_device() -> torch.device:
    """The trainer runs where vLLM runs: the CUDA and CPU kernels agree only to rounding."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_trainer(model_path: str, dtype: torch.dtype, device: torch.device | None = None):
    from transformers import AutoModelForCausalLM

    from vexact_vllm.model_patches import VexactForCausalLM
    from vexact_vllm.model_patches.trainers import transformers_hooks

    with transformers_hooks.installed():
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if not isinstance(model, VexactForCausalLM):
        raise TypeError(f"expected the vexact training class, got {type(model).__name__}")
    return model.to(device or trainer_device()).eval()


@torch.no_grad()
def trainer_log_probs(
    model,
    rollouts: list[Rollout],
    micro_batch: int,
    temperature: float | None = None,
    *,
    scored: dict | None = None,
    tick: Callable[[], object] | None = None,
) -> list[torch.Tensor]:
    """Per rollout, fp32 log-probs of its generated tokens, scored in packed micro-batches at the
    temperature the rollout asked for, or at `temperature` for all when given (the one log-prob
    function applies the effective temperature: greedy scores at 1).

    `scored`: a dict kept across calls, micro-batch -> its log-probs, so that a micro-batch met again
    (the same sequences in the same order at the same temperatures: another composition that sampled
    the same tokens) takes the log-probs the trainer computed for it, the same bits, instead of running
    the forward again. `tick()`: called after every micro-batch (a progress bar)."""
    from vexact_vllm.model_patches import PackedBatch

    size = micro_batch if micro_batch > 0 else len(rollouts)
    out: list[torch.Tensor] = []
    for lo in range(0, len(rollouts), size):
        chunk = rollouts[lo : lo + size]
        sequences = [r.prompt_ids + r.output_ids for r in chunk]
        taus = [r.temperature if temperature is None else temperature for r in chunk]
        key = (tuple(map(tuple, sequences)), tuple(taus))
        starts = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)[:-1].tolist()
        logp = None if scored is None else scored.get(key)
        if logp is None:
            device = model.lm_head.weight.device
            batch = PackedBatch.from_sequences(sequences, device=device)
            tau = torch.cat([torch.full((len(seq),), t) for seq, t in zip(sequences, taus)])  # [T]
            logp = model.packed_log_probs(batch, tau.to(device)).cpu()  # [T]; row t scores token t+1
            if scored is not None:
                scored[key] = logp
        for r, start in zip(chunk, starts):
            first = start + len(r.prompt_ids) - 1  # row that predicts the first generated token
            out.append(logp[first : first + len(r.output_ids)].clone())
        if tick is not None:
            tick()
    return out


def compare(rollouts: list[Rollout], trainer: list[torch.Tensor]) -> Comparison:
    tokens = mismatches = 0
    max_diff, first, per_position = 0.0, None, []
    for i, (r, t) in enumerate(zip(rollouts, trainer)):
        v = torch.tensor(r.logprobs, dtype=torch.float64).to(torch.float32)  # exact: they were fp32
        if v.shape != t.shape:
            raise ValueError(f"request {i}: {v.numel()} vLLM log-probs but {t.numel()} generated tokens")
        diff = (v.double() - t.double()).abs()
        bad = torch.nonzero(v != t).reshape(-1)
        tokens += v.numel()
        mismatches += bad.numel()
        if v.numel():
            max_diff = max(max_diff, float(diff.max()))
        per_position += list(enumerate(diff.tolist()))
        if first is None and bad.numel():
            k = int(bad[0])
            first = Mismatch(i, len(r.prompt_ids) + k, float(v[k]), float(t[k]), k)
    return Comparison(tokens, mismatches, max_diff, first, per_position)
