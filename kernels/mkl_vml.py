"""Resolve oneMKL VML's kernel dispatch once, on one thread, before any op can race on it.

On CPU, ATen sends contiguous fp32/fp64 unary math (`exp`, `log`, `sqrt`, `sin`, ...) to MKL VML,
each intra-op thread calling it on its own chunk with VML_HA (high accuracy) requested. oneMKL 2024.2
(the build torch's CPU wheels link) resolves each VML function's kernel lazily on its first call;
when that first call runs on two threads at once, one thread's chunk can be computed by a
low-accuracy kernel (pytorch/pytorch#188792). Seen here: `tests/kernels/sampling/test_logprob.py`'s first
log-softmax under CPU load had half its rows' exp 1-5 ulp off, which the next call did not
reproduce: a row's log-probs then differed between one call and the next, the contract's failure.

`warm_up_vml()` calls every VML function torch uses once per precision on a one-element tensor
(one thread: ATen does not split it), so the dispatch is settled before any parallel call. The
package runs it at import, in every process that imports it (engine cores and trainers alike).
"""

from __future__ import annotations

import torch

# The functions ATen routes to MKL VML (`ATen/cpu/vml.h`, IMPLEMENT_VML_MKL); a test reads that
# header of the installed torch and fails when it names one missing here.
VML_OPS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin",
    "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip
_DTYPES = (torch.float32, torch.float64)

warmed: list[tuple[str, torch.dtype]] = []  # what `warm_up_vml` called, for the tests


def warm_up_vml() -> list[tuple[str, torch.dtype]]:
    """Call each VML function once per precision on one element; returns the (op, dtype) pairs."""
    if not torch.backends.mkl.is_available() or warmed:
        return warmed
    for dtype in _DTYPES:
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_OPS:
            getattr(torch, name)(one)
            warmed.append((name, dtype))
    return warmed
