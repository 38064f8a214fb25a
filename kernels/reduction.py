"""Batch-invariant reduction building blocks for the torch (CPU reference) kernels.

Every reduction in `vexact_vllm.kernels` goes through one of these two helpers, so the order of
the additions is fixed by the row's own length and never by how many rows share the call.

What torch on CPU guarantees (checked by `tests/kernels/test_reduction.py`):

* `t.sum(-1)` over a contiguous last dim reduces each row serially with a vectorized cascade whose
  shape depends only on the row length: when the output has at least two elements, TensorIterator
  parallelises over output rows only (`find_split_dim` never picks a reduced dim), so each row's
  additions happen in the same order for any number of rows and any thread count.
* With exactly ONE output element and at least `GRAIN_SIZE` (32768) inputs, torch switches to a
  two-pass reduction that splits the row across threads: the result then depends on the thread
  count. `row_sum` sidesteps it by giving such a call a second (zero) row.
* BLAS (`mm`, `matmul`, `bmm`, `einsum`, `F.linear`, `sdpa`) picks code paths and K-splits by
  shape and thread count, so it never appears in a forward path.
* Elementwise `exp`, `log`, `sqrt`, `rsqrt`, `cos`, `sin`, `+ - * /` give the same bits for an
  element wherever it sits in the tensor. `torch.sigmoid`, `F.silu` and `torch.pow(scalar, t)` do
  NOT (their scalar tail loop uses a different formula from the vector body), so the kernels build
  SiLU from `exp` and divisions.
"""

import torch

# Rows of at most this many elements never reach torch's parallel two-pass path, even alone.
_GRAIN_SIZE = 32768


def row_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, with an order fixed by the last dim's length alone.

    t: [..., L] -> [...]. A call holding a single long row gets a zero companion row, which keeps
    torch on its per-row serial path (see the module docstring).
    """
    if t.numel() == t.shape[-1] and t.shape[-1] >= _GRAIN_SIZE:
        flat = t.reshape(1, t.shape[-1])
        pair = torch.cat([flat, torch.zeros_like(flat)], dim=0)  # [2, L]
        return pair.sum(-1)[0].reshape(t.shape[:-1])
    return t.sum(-1)


def sequential_sum(blocks: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim one element at a time, in index order: ((b0 + b1) + b2) + ...

    blocks: [..., nb] -> [...]. Used where the number of blocks varies with the problem size
    (vocabulary blocks of the log-softmax), so that no cascade shape depends on that number.
    """
    acc = blocks[..., 0]
    for b in range(1, blocks.shape[-1]):
        acc = acc + blocks[..., b]
    return acc
