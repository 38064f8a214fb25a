"""The PPO outputs (`token_log_probs_and_entropy`: per-token log-probs and entropy, each with a
hand-written chunked backward) against autograd of a float64 reference built from plain torch ops
(logprob_reference.py: the formula and the bounds). A random upstream gradient is backpropagated
through both outputs of the op and of the reference; the gradients w.r.t. hidden and weight must
agree within 1e-5 norm-wise for fp32 inputs, within three bf16 roundings for bf16 inputs. Every
draw comes from a `torch.Generator` seeded with the case's seed, named in each message.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vexact_vllm.model_patches.trainers import ppo_outputs
from vexact_vllm.model_patches.trainers.ppo_outputs import token_log_probs_and_entropy

sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module (importlib import mode)

from logprob_reference import assert_forward_close, assert_gradients_close  # noqa: E402

HIDDEN = 48
VOCAB = 1500  # not a multiple of the torch path's 1024-long vocabulary block


def _case(seed, rows, vocab, dtype, masked, ignored=0):
    """(hidden, weight, targets, allowed or None, upstream grads of log-probs and entropy), seeded."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(vocab, HIDDEN, generator=g) * 0.3).to(dtype)  # logits of std ~2
    allowed = None
    ids = torch.arange(vocab)
    if masked:  # verl's rollout mask: the ids past the tokenizer, plus scattered banned ids
        allowed = torch.rand(vocab, generator=g) < 0.9
        allowed[-100:] = False
        ids = allowed.nonzero()[:, 0]
    targets = ids[torch.randint(0, len(ids), (rows,), generator=g)]
    targets[torch.randperm(rows, generator=g)[:ignored]] = -1
    upstream = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    return hidden, weight, targets, allowed, upstream


def _check(seed, rows, vocab, dtype, temperature, masked, ignored=0, device="cpu"):
    """The op on `device` vs the fp64 reference: forward, gradients, zero gradient where ignored."""
    hidden, weight, targets, allowed, upstream = _case(seed, rows, vocab, dtype, masked, ignored)
    h, w = (t.to(device, copy=True).requires_grad_() for t in (hidden, weight))
    tau = temperature if isinstance(temperature, torch.Tensor) else torch.full((rows,), float(temperature))
    on_device = temperature.to(device) if isinstance(temperature, torch.Tensor) else temperature
    mask = None if allowed is None else allowed.to(device)
    log_p, entropy = token_log_probs_and_entropy(h, w, targets.to(device), on_device, mask)
    ((log_p * upstream[0].to(device)).sum() + (entropy * upstream[1].to(device)).sum()).backward()
    label = f"seed {seed}"
    assert_forward_close((log_p, entropy), hidden, weight, targets, tau, allowed, label)
    assert_gradients_close((h.grad, w.grad), hidden, weight, targets, tau, allowed, upstream, label)
    assert bool((h.grad.cpu()[targets < 0] == 0).all()), f"ignored rows got a gradient ({label})"


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 5, 127])
def test_fp32_gradients_match_fp64_autograd(rows, temperature, masked):
    _check(seed=rows, rows=rows, vocab=VOCAB, dtype=torch.float32, temperature=temperature, masked=masked)


def test_chunked_rows_row_temperatures_and_ignored_targets(monkeypatch):
    """Many entropy chunks (the last one partial), a vocabulary of 1031 ids, per-row temperatures
    through the rule (0 scores at 1, 0.005 at 0.01) and ignored targets (0 and no gradient)."""
    monkeypatch.setattr(ppo_outputs, "ENTROPY_CHUNK_ROWS", 16)
    rows = 127
    tau = torch.tensor([0.0, 0.005, 0.7, 1.0, 1.3]).repeat(26)[:rows]
    _check(seed=7, rows=rows, vocab=1031, dtype=torch.float32, temperature=tau, masked=True, ignored=9)


@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("rows", [5, 127])
def test_bf16_gradients_within_rounding_bound_of_fp64(rows, masked):
    _check(seed=100 + rows, rows=rows, vocab=VOCAB, dtype=torch.bfloat16, temperature=0.7, masked=masked)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_cuda_gradients_match_fp64_autograd(masked, dtype):
    """The same bounds on the CUDA path (Triton log-prob and log-softmax kernels, CUDA GEMMs)."""
    for rows in (1, 5, 127):
        for temperature in (1.0, 0.7):
            _check(rows, rows, VOCAB, dtype, temperature, masked, device="cuda")
