"""The canonical reduction of a K-sliced linear: what tensor-parallel row-parallel layers reproduce.

Legend: M rows, N output columns, K the reduction, S = k_slices (a power of two, at most 8, dividing
K), T the tensor-parallel ranks (a power of two dividing S).
Math, for y = x @ W^T + b with K cut into S equal slices k_s = [s K/S, (s+1) K/S):
    p_s[m, n] = sum over k in k_s of fp32(x[m, k]) fp32(W[n, k])   one `linear` of the slice's shape
                                                                    (its own batch-invariant order)
    acc       = tree(p_0 .. p_{S-1})                                 balanced pairwise tree in fp32:
                                                                    ((p0 + p1) + (p2 + p3)) + ...
    y         = (acc + fp32(b)).to(out_dtype)                        one rounding
Why a balanced tree: rank r of T holds the contiguous slices [r S/T, (r+1) S/T), which form one
subtree, so `linear_partial` on the rank's shard gives exactly that subtree's fp32 value, and
`combine_partials` of the T ranks' partials (gathered in rank order) finishes the same tree. Any T
dividing S gives the trainer's bits: no all-reduce whose order depends on an algorithm or a message
size. S = 1 is the ordinary `linear`. The slices themselves are `linear.slice_partials` (either backend).
"""

from collections.abc import Sequence

import torch

MAX_K_SLICES = 8


def check_k_slices(k: int, k_slices: int) -> None:
    if isinstance(k_slices, bool) or not isinstance(k_slices, int) or k_slices not in (1, 2, 4, 8):
        raise ValueError(f"k_slices must be 1, 2, 4 or 8 (a power of two up to {MAX_K_SLICES}), got {k_slices!r}")
    if k % k_slices:
        raise ValueError(f"K = {k} is not divisible by k_slices = {k_slices}: the slices must be equal")


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Balanced pairwise sum of a power-of-two number of tensors, adjacent pairs first."""
    parts = list(parts)
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def combine_partials(partials: Sequence[torch.Tensor], bias: torch.Tensor | None, out_dtype: torch.dtype):
    """[..., N] in out_dtype: the ranks' fp32 partials (rank order) finished as the canonical tree, + bias."""
    acc = tree_sum(partials)
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)
