"""Sampling: the Gumbel-max draw, and the decode step's sampling in one function (the token, its
log-prob and rank from the fp32 logits).

`gumbel_argmax(log_probs, seeds, positions)`: token = argmax_v(log_probs[v] + g_v), g the noise of
gumbel.py (keyed by the request's seed, the position and the token id only, so a request samples
the same tokens alone or in any batch, in any order); ties go to the lowest id. The CUDA path is
gumbel_triton.py.

`sample_tokens(logits, temperature, seeds, positions, draw=, output=)` is, by definition, this
composition (`sample_composed` runs it as written: the torch path, and on CUDA tensors the sampler's
kernels before this fusion; the Triton path, sample_triton.py, fuses it without writing the [M, V]
log-probs, with the same bits):
    log_probs       = log_softmax(logits, temperature)                                      [M, V]
    tokens          = draw "greedy":  argmax_v log_probs[m, v]      (the first maximum)       [M]
                      draw "sampled": gumbel_argmax(log_probs, seeds, positions)
                      draw "mixed":   greedy where temperature[m] == 0, sampled elsewhere
    token_log_probs = log_probs[m, tokens[m]]                                                [M]
    ranks           = #{v : log_probs[m, v] >= token_log_probs[m]}  (vLLM's selected-token rank)
`output` picks what is returned: "tokens"; "token_log_probs" (tokens, their log-probs and ranks:
what vLLM returns for a request that asks for the sampled token's log-prob only, an RL rollout's
case); "log_probs" (tokens and the whole log-probs, for top-k log-probs or truncation).

Greedy is temperature 0 exactly, the rows the log-prob functions score at 1: a caller that treats
small positive temperatures as greedy too (vLLM: below 1e-5) zeroes them first (the samplers do).
"""

from typing import NamedTuple

import torch

from ..checks import (
    check_dtype,
    check_logits,
    check_noise_keys,
    check_out,
    check_same_device,
    check_temperature,
)
from ..dispatch import backend_for
from .gumbel import gumbel_noise
from .logit_rules import temperature_column
from .logprob import log_softmax

DRAWS = ("greedy", "sampled", "mixed")
OUTPUTS = ("tokens", "token_log_probs", "log_probs")
# Rows per chunk of the [rows, V] hash in gumbel_argmax's torch path; only bounds memory.
_GUMBEL_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------------------------
# Gumbel-max draw
# ---------------------------------------------------------------------------------------------


def _gumbel_argmax_torch(log_probs, seeds, positions, threshold=None, out=None):
    n_rows, vocab = log_probs.shape
    step = max(1, _GUMBEL_ELEMENTS // max(vocab, 1))
    out = torch.empty(n_rows, dtype=torch.int64, device=log_probs.device) if out is None else out
    for r0 in range(0, n_rows, step):
        rows = slice(r0, r0 + step)
        lp = log_probs[rows]
        if threshold is not None:  # truncated sampling: ids below the row's threshold cannot win
            lp = torch.where(lp >= threshold[rows, None], lp, float("-inf"))
        out[rows] = (lp + gumbel_noise(seeds[rows], positions[rows], vocab)).argmax(-1)
    return out


def _gumbel_argmax_triton(log_probs, seeds, positions, threshold=None, out=None):
    from .gumbel_triton import gumbel_argmax_triton  # imported on first use: no Triton on CPU

    return gumbel_argmax_triton(log_probs, seeds, positions, threshold, out=out)


_GUMBEL_IMPLS = {"torch": _gumbel_argmax_torch, "triton": _gumbel_argmax_triton}


def gumbel_argmax(
    log_probs: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    threshold: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [M]: argmax_v(log_probs[m, v] + gumbel(seeds[m], positions[m], v)) (gumbel.py's noise) over the ids with
    log_probs[m, v] >= threshold[m] (all of them without a threshold); written into `out` (a
    contiguous int64 [M]) when given.

    log_probs: fp32 [M, V] (already at the request's temperature; greedy rows should take
    log_probs.argmax(-1) instead); seeds, positions: int64 [M]; threshold: fp32 [M] or None
    (`kernels.sampling.truncation.truncation_threshold`: top-k, top-p, min-p). Ties go to the lowest token id.
    """
    check_logits(log_probs, "log_probs")
    check_noise_keys(seeds, positions, log_probs.shape[0])
    if threshold is not None:
        check_dtype("threshold", threshold, (torch.float32,))
        if tuple(threshold.shape) != (log_probs.shape[0],):
            raise ValueError(f"threshold must have shape ({log_probs.shape[0]},), got {tuple(threshold.shape)}")
    check_same_device(log_probs=log_probs, seeds=seeds, positions=positions, threshold=threshold)
    check_out(out, (log_probs.shape[0],), torch.int64, log_probs.device)
    return _GUMBEL_IMPLS[backend_for(log_probs)](log_probs, seeds, positions, threshold, out)


# ---------------------------------------------------------------------------------------------
# the decode step's sampling
# ---------------------------------------------------------------------------------------------


class Sampled(NamedTuple):
    """What `sample_tokens` returns (None where `output` leaves it out); as `out=`, the buffers to
    write into (the CUDA graphs' static tensors)."""

    tokens: torch.Tensor  # int64 [M]
    token_log_probs: torch.Tensor | None = None  # fp32 [M]          ("token_log_probs")
    ranks: torch.Tensor | None = None  # int64 [M]                    ("token_log_probs")
    log_probs: torch.Tensor | None = None  # fp32 [M, V], may be the logits themselves ("log_probs")


def sample_composed(logits, tau, seeds, positions, draw, output, out: Sampled) -> None:
    """The composition of the module docstring, written into `out`, each op on the backend its
    public function picks (the torch path here; benchmarks/bench_sampler.py times it on CUDA)."""
    log_probs = log_softmax(logits, tau, out=out.log_probs)
    if draw == "greedy":
        torch.argmax(log_probs, -1, out=out.tokens)
    elif draw == "sampled":
        gumbel_argmax(log_probs, seeds, positions, out=out.tokens)
    else:
        drawn = gumbel_argmax(log_probs, seeds, positions)
        torch.where(tau == 0, log_probs.argmax(-1), drawn, out=out.tokens)
    if output == "token_log_probs":
        token_lp = log_probs.gather(1, out.tokens[:, None])[:, 0]
        out.token_log_probs.copy_(token_lp)
        torch.sum(log_probs >= token_lp[:, None], -1, out=out.ranks)


def _sample_triton(logits, tau, seeds, positions, draw, output, out: Sampled) -> None:
    from .sample_triton import sample_triton  # imported on first use: no Triton on CPU

    sample_triton(logits, tau, seeds, positions, draw, output, *out)


_IMPLS = {"torch": sample_composed, "triton": _sample_triton}


def _buffers(logits: torch.Tensor, output: str, out: Sampled | None) -> Sampled:
    """`out` checked against `output`, or new buffers for it."""
    n_rows, dev = logits.shape[0], logits.device
    wanted = {
        "tokens": ((n_rows,), torch.int64, True),
        "token_log_probs": ((n_rows,), torch.float32, output == "token_log_probs"),
        "ranks": ((n_rows,), torch.int64, output == "token_log_probs"),
        "log_probs": (tuple(logits.shape), torch.float32, output == "log_probs"),
    }
    if out is None:
        return Sampled(*(torch.empty(s, dtype=d, device=dev) if on else None for s, d, on in wanted.values()))
    if not isinstance(out, Sampled):
        raise ValueError(f"out must be a Sampled of buffers, got {type(out).__name__}")
    for name, (shape, dtype, on) in wanted.items():
        buf = getattr(out, name)
        if on != (buf is not None):
            raise ValueError(f"out.{name} must be {'a buffer' if on else 'None'} for output={output!r}")
        check_out(buf, shape, dtype, dev, logits)
    return out


def sample_tokens(
    logits: torch.Tensor,
    temperature,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
    *,
    draw: str,
    output: str = "tokens",
    out: Sampled | None = None,
) -> Sampled:
    """The module docstring's composition of fp32 logits [M, V] (contiguous rows) at `temperature`
    (requested: float or fp32 [M], 0 = greedy); seeds, positions: int [M], the Gumbel noise's key
    (positions: of the token being sampled; both may be None for draw "greedy"); `out`: a Sampled
    of buffers for `output` (inference only). Returns a Sampled with the fields `output` asks for."""
    if draw not in DRAWS:
        raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    check_logits(logits)
    n_rows = logits.shape[0]
    check_temperature(temperature, n_rows, logits.device)
    if draw != "greedy":
        check_noise_keys(seeds, positions, n_rows)
        check_same_device(logits=logits, seeds=seeds, positions=positions)
    out = _buffers(logits, output, out)
    tau = temperature_column(temperature, n_rows, logits.device, effective=False)[:, 0]  # requested, [M]
    _IMPLS[backend_for(logits)](logits, tau.contiguous(), seeds, positions, draw, output, out)
    return out
