"""Rotary position embedding (NeoX / Hugging Face "rotate_half" style).

Cache: for rot_dim = int(head_dim * partial_rotary_factor) and inverse frequencies inv_freq[i]
(i < rot_dim / 2, defined as in transformers' `ROPE_INIT_FUNCTIONS`), row p of the cache is
    cat(cos(p * inv_freq), sin(p * inv_freq)) * a                 [rot_dim] fp32
with a the rope type's attention factor (YaRN's; 1 for the others), computed in float64 (inverse
frequencies with Python floats, then elementwise torch ops whose bits do not depend on tensor
shape) and rounded once to fp32, so a row is the same whatever `max_positions` is. transformers
computes the YaRN frequencies in fp32 and multiplies its fp32 cos/sin by the factor; the table here
differs from its by at most a rounding (and from DeepSeek-V3's, which rounds cos/sin to bf16 before
rotating, by that rounding).

Apply: with x1, x2 the two halves of x[..., :rot_dim] in fp32 and c, s the cache row of the
token's position,
    out[..., :rot_dim] = x * cat(c, c) + rotate_half(x) * cat(s, s),  rotate_half(x) = cat(-x2, x1)
cast to the input dtype; dims past rot_dim pass through unchanged.

With `qk_norm` = (q_weight, k_weight, eps) (Qwen3's per-head q_norm / k_norm), q and k are first
`rms_norm`ed per head (rms_norm.py, rounded to their dtype), then rotated: one op, so the Triton
path runs both in one launch (rope_triton.py) and gives the bits of the two ops in sequence.

Invariant: elementwise per token and head; no reduction but the norm's, over one head's D values.
"""

import math

import torch

from ..checks import check_rope_inputs
from ..dispatch import backend_for
from .rms_norm import rms_norm_torch

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' (and DeepSeek's) YaRN magnitude scale: 0.1 * mscale * ln(scale) + 1 above scale 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: dict, max_positions: int | None) -> float:
    factor = scaling.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = max_positions / scaling["original_max_position_embeddings"]
    return float(factor)


def attention_factor(scaling: dict | None, max_positions: int | None = None) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' `attention_factor`): given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set, else mscale(factor);
    1 for every other rope type. `max_positions`: the model's max_position_embeddings (for a YaRN
    config without a factor)."""
    if scaling is None or scaling.get("rope_type", scaling.get("type", "default")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_positions)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(rot_dim: int, theta: float, scaling: dict, max_positions: int | None) -> list[float]:
    """transformers' `_compute_yarn_parameters` frequencies, in float64."""
    factor = _yarn_factor(scaling, max_positions)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (rot_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    out = []
    for i in range(rot_dim // 2):
        pos_freq = theta ** (2 * i / rot_dim)
        extrapolation = 1 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1 - the linear ramp
        out.append((1.0 / (factor * pos_freq)) * (1 - extrapolation) + (1.0 / pos_freq) * extrapolation)
    return out


def _inv_freq(rot_dim: int, theta: float, scaling: dict | None, max_positions: int | None = None) -> list[float]:
    """Inverse frequencies [rot_dim / 2] as Python floats (float64), per transformers' definitions."""
    inv_freq = [1.0 / (theta ** (i / rot_dim)) for i in range(0, rot_dim, 2)]
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (supported: {', '.join(_SUPPORTED_ROPE_TYPES)}); "
            "its frequencies depend on the sequence length or need attention scaling"
        )
    if rope_type == "linear":
        factor = float(scaling["factor"])
        return [f / factor for f in inv_freq]
    if rope_type == "yarn":
        return _yarn_inv_freq(rot_dim, theta, scaling, max_positions)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        out = []
        for f in inv_freq:
            wavelen = 2 * math.pi / f
            scaled = f / factor if wavelen > low_freq_wavelen else f
            if not (wavelen < high_freq_wavelen) and not (wavelen > low_freq_wavelen):
                smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                scaled = (1 - smooth) * scaled / factor + smooth * scaled
            out.append(scaled)
        return out
    return inv_freq


def rope_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None = None,
    partial_rotary_factor: float = 1.0,
    model_max_positions: int | None = None,
) -> torch.Tensor:
    """fp32 [max_positions, rot_dim] = cat(cos, sin) * attention factor, each [rot_dim / 2]; on the CPU.

    `scaling` is the Hugging Face `rope_scaling` / `rope_parameters` dict (rope_type "default",
    "linear", "llama3" or "yarn"); anything else raises ValueError. `model_max_positions`: the
    model's max_position_embeddings where it differs from `max_positions` (a YaRN config without a
    factor takes its factor from it).
    """
    if head_dim <= 0 or max_positions <= 0:
        raise ValueError(f"head_dim ({head_dim}) and max_positions ({max_positions}) must be positive")
    rot_dim = int(head_dim * partial_rotary_factor)
    if rot_dim <= 0 or rot_dim % 2 != 0 or rot_dim > head_dim:
        raise ValueError(
            f"rot_dim = int({head_dim} * {partial_rotary_factor}) = {rot_dim} must be even, in (0, head_dim]"
        )
    model_max = model_max_positions or max_positions
    inv_freq = torch.tensor(_inv_freq(rot_dim, float(theta), scaling, model_max), dtype=torch.float64)  # [R/2]
    positions = torch.arange(max_positions, dtype=torch.float64)  # [P]
    freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
    table = torch.cat([torch.cos(freqs), torch.sin(freqs)], dim=-1)  # [P, R] float64
    factor = attention_factor(scaling, model_max)
    return (table if factor == 1.0 else table * factor).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, R/2] fp32 -> [T, H, D] in x.dtype."""
    half = cos.shape[-1]
    rot = x[..., : 2 * half].float()  # [T, H, R]
    x1, x2 = rot[..., :half], rot[..., half:]
    cos_full = torch.cat([cos, cos], dim=-1)  # [T, 1, R]
    sin_full = torch.cat([sin, sin], dim=-1)
    out = rot * cos_full + torch.cat([-x2, x1], dim=-1) * sin_full  # [T, H, R]
    if 2 * half == x.shape[-1]:
        return out.to(x.dtype)
    return torch.cat([out.to(x.dtype), x[..., 2 * half :]], dim=-1)


def _apply_rope_torch(q, k, positions, cache, qk_norm=None):
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps)
    if positions.numel() > 0 and (int(positions.min()) < 0 or int(positions.max()) >= cache.shape[0]):
        raise ValueError(f"positions must lie in [0, {cache.shape[0]}) (the cache's max_positions)")
    rows = cache[positions]  # [T, R]
    half = cache.shape[1] // 2
    cos = rows[:, None, :half]  # [T, 1, R/2]
    sin = rows[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _apply_rope_triton(q, k, positions, cache, qk_norm=None):
    from .rope_triton import apply_rope_triton  # imported on first use: no Triton on CPU

    return apply_rope_triton(q, k, positions, cache, qk_norm)


_IMPLS = {"torch": _apply_rope_torch, "triton": _apply_rope_triton}


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] (bf16/fp32) at positions [T] int64 with `cache`.

    cache: fp32 [max_positions, rot_dim] from `rope_cache`, on the device of q. qk_norm: optional
    (q_weight [D], k_weight [D], eps): RMSNorm each head of q and k first. Returns new tensors.
    """
    check_rope_inputs(q, k, positions, cache, qk_norm)
    if qk_norm is not None:
        qk_norm = (qk_norm[0], qk_norm[1], float(qk_norm[2]))
    return _IMPLS[backend_for(q)](q, k, positions, cache, qk_norm)
