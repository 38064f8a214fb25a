"""The Gated DeltaNet input rules, one definition each: the q/k l2 norm, the q scale and the gates.

Math (fp32 throughout), per token t, k head h and v head hv (hv uses k head hv // (HV / HK), as
transformers' `repeat_interleave` of q and k over the v heads):
    l2(x)   = x * rsqrt(sum_d x_d^2 + 1e-6)                   (eps inside the root, as transformers)
    q_hat   = l2(fp32 q) * SCALE,  SCALE = fp32(d_k^-1/2)     (normalise first, then scale)
    k_hat   = l2(fp32 k)
    g       = -exp(fp32 A_log) * softplus(fp32 a + fp32 dt_bias),
              softplus(x) = x if x > 20 else log(1 + exp(x))
    beta    = fp32(round_to_dtype(b)(1 / (1 + exp(-fp32 b))))
beta is rounded to b's dtype (bf16 in a bf16 model) before use, as transformers' `b.sigmoid()` and
vLLM's gating kernel store it; g stays fp32.

Differences from transformers 5.19 (`models/qwen3_next/modeling_qwen3_next.py`), each below the
contract (both sides of the contract run these definitions):
- its recurrent (decode) path divides q by sqrt(d_k); its chunked path multiplies by d_k^-1/2, as here;
- `F.softplus` evaluates log1p(exp(x)); here log(1 + exp(x)), as vLLM's gating kernel (equal above
  x ~ -17, where both are below 4e-8);
- sigmoid and SiLU are built from `exp` and divisions (torch's CPU sigmoid rounds differently in its
  vector body and scalar tail, see reduction.py).
flash-linear-attention's l2norm divides by sqrt(sum + eps) and its chunked kernels round q_hat and
k_hat to bf16 before use; here they stay fp32.

The torch functions serve the CPU path and the Triton backward (which recomputes the inputs of the
recurrence with autograd); the Triton forward kernels evaluate the same formulas in-kernel.
"""

import torch

from ..reduction import row_sum

L2NORM_EPS = 1e-6
# softplus(x) = x above this (torch's default threshold).
SOFTPLUS_THRESHOLD = 20.0


def qk_scale(d_k: int) -> float:
    """d_k^-1/2 rounded to fp32, as a Python float: the torch path and the kernels multiply by the
    same fp32 value."""
    return torch.tensor(d_k**-0.5, dtype=torch.float32).item()


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """fp32 x [..., D] -> x * rsqrt(sum(x^2) + eps) over the last dim; one `row_sum` per row."""
    x = x.float()
    return x * torch.rsqrt(row_sum(x * x) + L2NORM_EPS)[..., None]


def normalized_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_hat, k_hat), fp32 [T, HK, DK]: l2-normalised, q then scaled by d_k^-1/2."""
    return l2_normalize(q) * qk_scale(q.shape[-1]), l2_normalize(k)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


class _Gates(torch.autograd.Function):
    """g and beta with a hand-written backward: the autograd of the exp-built formulas would give
    inf * 0 = NaN where exp overflows (|x| above ~88)."""

    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias):
        x = a.float() + dt_bias.float()  # [T, HV]
        soft = torch.where(
            x > SOFTPLUS_THRESHOLD, x, torch.log(1.0 + torch.exp(torch.clamp(x, max=SOFTPLUS_THRESHOLD)))
        )
        decay = torch.exp(A_log.float())  # [HV]
        g = -decay * soft
        s = _sigmoid(b.float())
        beta = s.to(b.dtype).float()
        ctx.save_for_backward(x, soft, decay, s)
        ctx.dtypes = (a.dtype, b.dtype, A_log.dtype, dt_bias.dtype)
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        x, soft, decay, s = ctx.saved_tensors
        a_dtype, b_dtype, log_dtype, bias_dtype = ctx.dtypes
        dg = dg.float()
        dx = -decay * dg * torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), _sigmoid(x))  # [T, HV]
        d_a_log = (-decay * soft * dg).sum(0)  # [HV]: a fixed-order torch sum (deterministic)
        db = dbeta.float() * s * (1.0 - s)  # through the rounding of beta (straight through)
        return dx.to(a_dtype), db.to(b_dtype), d_a_log.to(log_dtype), dx.sum(0).to(bias_dtype)


def gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), fp32 [T, HV], from a, b [T, HV] and A_log, dt_bias [HV] (formulas above)."""
    return _Gates.apply(a, b, A_log, dt_bias)


def token_sequences(cu_seqlens: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq [T], pos [T]) int64 on cu_seqlens' device: each packed token's sequence and its position
    in that sequence's rows of the call (device ops only: no host sync). A row past the last sequence's
    end (a CUDA graph's padding rows: the graph runs the rows it was captured with) gets seq N, one past
    the last sequence: callers index per-sequence tensors through `per_row_sequences`."""
    cu = cu_seqlens.long()
    tokens = torch.arange(n_tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)  # [T]
    return seq, tokens - cu[seq]


def stateful(slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """bool [N]: the sequence continues from its slot's state (it has one, and a slot: -1 is none)."""
    return has_state & (slots >= 0)


def per_row_sequences(values: torch.Tensor, padding) -> torch.Tensor:
    """values [N] with `padding` appended as entry N: what `token_sequences`' seq N (padding rows) reads."""
    return torch.cat([values, values.new_full((1,), padding)])
