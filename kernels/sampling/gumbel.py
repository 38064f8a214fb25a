"""The Gumbel noise of sampling: a counter-based hash of (request seed, position, token id), so a
request samples the same tokens alone or in any batch, in any order. The definition, with its torch
reference; `gumbel_triton.py` computes the same noise in its kernels (from these constants) and
`sample.gumbel_argmax` draws with it.

Noise g_v = -log(-log(u_v)) in fp32, u_v a function of (seed, position, v) only (int64 torch ops,
masked):
    mix(x)   = splitmix64's finalizer on 63 bits: x ^= x >> 30; x *= C1; x ^= x >> 27; x *= C2;
               x ^= x >> 31, each product wrapped mod 2^64 then masked to 63 bits
    key      = mix(mix(seed ^ GOLDEN) ^ position) mod 2^32       once per row (seed, position on 63 bits)
    hash(x)  = a 32-bit finalizer ("lowbias32"): x ^= x >> 16; x *= H1; x ^= x >> 15; x *= H2;
               x ^= x >> 16, each product wrapped mod 2^32 (a bijection of 32-bit words)
    h        = hash(key ^ v)                                      per token id, 32-bit arithmetic only
    u        = ((h >> 9) + 0.5) / 2^23                            top 23 bits: exact in fp32, in (0, 1)
The per-id hash is 32-bit because it runs V times a row (a CUDA kernel's cost was its 64-bit
products); the row key keeps splitmix64's 63 bits of seed and position.
"""

import torch

MASK63 = (1 << 63) - 1
GOLDEN = 0x9E3779B97F4A7C15 & MASK63
# splitmix64 multipliers as signed int64 (same low 64 bits): torch has no uint64 arithmetic.
MIX_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
MIX_C2 = 0x94D049BB133111EB - (1 << 64)
# The per-id 32-bit hash (lowbias32's multipliers) and its mask.
MASK32 = (1 << 32) - 1
HASH_H1 = 0x7FEB352D
HASH_H2 = 0x846CA68B
# Bits of the hash that make the uniform (exact in fp32's 24-bit significand).
UNIFORM_BITS = 23


def mix63(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer kept on 63 bits; x: int64 in [0, 2^63), so `>>` is a logical shift."""
    x = ((x ^ (x >> 30)) * MIX_C1) & MASK63
    x = ((x ^ (x >> 27)) * MIX_C2) & MASK63
    return x ^ (x >> 31)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The per-id 32-bit finalizer; x: int64 in [0, 2^32): products wrap mod 2^64, masked to 32 bits."""
    x = ((x ^ (x >> 16)) * HASH_H1) & MASK32
    x = ((x ^ (x >> 15)) * HASH_H2) & MASK32
    return x ^ (x >> 16)


def gumbel_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [M, V] uniforms in (0, 1) keyed by (seeds[m], positions[m], v) only: the hash's u."""
    row_key = mix63(mix63((seeds.long() & MASK63) ^ GOLDEN) ^ (positions.long() & MASK63)) & MASK32
    token_ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)  # [V]
    h = hash32(row_key[:, None] ^ token_ids[None, :])  # [M, V]
    return ((h >> (32 - UNIFORM_BITS)).float() + 0.5) * (2.0**-UNIFORM_BITS)  # exact, in (0, 1)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [M, V] Gumbel noise keyed by (seeds[m], positions[m], v) only."""
    return -torch.log(-torch.log(gumbel_uniform(seeds, positions, vocab)))
