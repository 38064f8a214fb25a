import math

import pytest
import torch

from vexact_vllm.kernels import apply_rope, rope_cache

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _reference_inv_freq(rot_dim, theta, scaling):
    inv = torch.tensor([1.0 / theta ** (i / rot_dim) for i in range(0, rot_dim, 2)], dtype=torch.float64)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, (1 - smooth) * out / factor + smooth * out, out)
    return inv


def _reference_rope(x, positions, inv_freq):
    rot = 2 * inv_freq.shape[0]
    ang = positions.double()[:, None] * inv_freq[None, :]  # [T, R/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    xr = x[..., :rot].double()
    x1, x2 = xr.chunk(2, -1)
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, x[..., rot:].double()], -1)


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3], ids=["default", "linear", "llama3"]
)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_cache_matches_reference(scaling, partial):
    cache = rope_cache(128, 300, 500000.0, scaling, partial)
    rot = int(128 * partial)
    assert cache.shape == (300, rot) and cache.dtype == torch.float32
    inv = _reference_inv_freq(rot, 500000.0, scaling)
    ang = torch.arange(300, dtype=torch.float64)[:, None] * inv[None, :]
    assert torch.equal(cache, torch.cat([ang.cos(), ang.sin()], -1).float())


@pytest.mark.parametrize(
    "scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3], ids=["default", "linear", "llama3"]
)
def test_inv_freq_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=16384,
        rope_parameters=params,
    )
    kind = params["rope_type"]
    if kind == "default":
        inv_hf = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    else:
        inv_hf, _ = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    cache = rope_cache(128, 2, 500000.0, scaling)
    inv_ours = torch.atan2(cache[1, 64:].double(), cache[1, :64].double())  # angle at position 1
    torch.testing.assert_close(inv_ours, inv_hf.double(), rtol=1e-6, atol=0)


def test_cache_rows_independent_of_max_positions():
    assert torch.equal(rope_cache(64, 1000, 10000.0)[:77], rope_cache(64, 77, 10000.0))


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])  # yarn: tests/kernels/norms/test_rope_yarn.py
def test_unsupported_rope_type(kind):
    with pytest.raises(ValueError, match=kind):
        rope_cache(64, 16, 10000.0, {"rope_type": kind, "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_apply_accuracy_and_invariance(threads, dtype, partial):
    cache = rope_cache(64, 512, 10000.0, partial_rotary_factor=partial)
    positions = torch.randint(0, 512, (129,))
    q = torch.randn(129, 4, 64).to(dtype)
    k = torch.randn(129, 2, 64).to(dtype)
    q_out, k_out = apply_rope(q, k, positions, cache)
    assert q_out.dtype == dtype and q_out.shape == q.shape
    inv = _reference_inv_freq(int(64 * partial), 10000.0, None)
    torch.testing.assert_close(
        q_out.double(), _reference_rope(q, positions, inv), rtol=TOL[dtype], atol=TOL[dtype]
    )
    torch.testing.assert_close(
        k_out.double(), _reference_rope(k, positions, inv), rtol=TOL[dtype], atol=TOL[dtype]
    )
    if partial < 1.0:
        assert torch.equal(q_out[..., 32:], q[..., 32:])
    with threads(1):
        for t in (0, 5, 128):
            q1, k1 = apply_rope(q[t : t + 1], k[t : t + 1], positions[t : t + 1], cache)
            assert torch.equal(q1, q_out[t : t + 1]) and torch.equal(k1, k_out[t : t + 1])


def test_gradients_match_float64_reference():
    cache = rope_cache(32, 64, 10000.0, partial_rotary_factor=0.5)
    positions = torch.randint(0, 64, (9,))
    q = torch.randn(9, 3, 32, requires_grad=True)
    k = torch.randn(9, 1, 32, requires_grad=True)
    gq, gk = torch.randn(9, 3, 32), torch.randn(9, 1, 32)
    q_out, k_out = apply_rope(q, k, positions, cache)
    ((q_out * gq).sum() + (k_out * gk).sum()).backward()
    inv = _reference_inv_freq(16, 10000.0, None)
    qd, kd = (t.detach().double().requires_grad_() for t in (q, k))
    (
        (_reference_rope(qd, positions, inv) * gq.double()).sum()
        + (_reference_rope(kd, positions, inv) * gk.double()).sum()
    ).backward()
    torch.testing.assert_close(q.grad.double(), qd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad.double(), kd.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "q,k,positions",
    [
        (torch.randn(4, 2, 16).half(), torch.randn(4, 2, 16).half(), torch.arange(4)),
        (torch.randn(4, 2, 16), torch.randn(4, 2, 16).bfloat16(), torch.arange(4)),
        (torch.randn(4, 2, 16), torch.randn(3, 2, 16), torch.arange(4)),
        (torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.arange(4).float()),
        (torch.randn(4, 2, 16), torch.randn(4, 2, 16), torch.tensor([0, 1, 2, 99])),
        (torch.randn(4, 32), torch.randn(4, 32), torch.arange(4)),
    ],
)
def test_bad_input_raises(q, k, positions):
    with pytest.raises(ValueError):
        apply_rope(q, k, positions, rope_cache(16, 8, 10000.0))
