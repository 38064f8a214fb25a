"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: the one module that owns its
design, i.e. the state layout both sides agree on and every call of the conv and recurrence kernels.

Legend: T tokens (rows of the call), n of them tokens (the rest padding), N sequences, H hidden size,
HK / HV key / value heads, DK / DV their head dims, C = 2 HK DK + HV DV conv channels, W conv width.
Parameter names are Hugging Face's (`linear_attn.*` of transformers' Qwen3NextGatedDeltaNet and
Qwen3_5GatedDeltaNet); each family subclass defines its projections (`project`):
    qkv, z, b, a = project(x)                         [T, C], [T, HV, DV], [T, HV], [T, HV]
    qkv = causal_conv1d(qkv, conv1d.weight)          depthwise, W taps, SiLU; q | k | v channels
    q, k, v = split(qkv, [HK DK, HK DK, HV DV])       [T, HK, DK], [T, HK, DK], [T, HV, DV]
    o   = incremental_gated_delta_rule(q, k, v, a, b, A_log, dt_bias)
          (q, k l2-normalised, q scaled by DK^-1/2, g = -exp(A_log) softplus(a + dt_bias),
           beta = sigmoid(b): kernels/gated_delta/rules.py)                            [T, HV, DV]
    o   = silu(z) * rms_norm(o, norm.weight)         per v head (transformers' gated RMSNorm)
    out = out_proj(o)                                 [T, H]

The design (design C, `kernels.incremental_gated_delta_rule`, docs/architecture.md "Gated DeltaNet"):
chunks of CHUNK = 64 rows anchored at multiple-of-64 positions in training, prefill, chunked prefill
and decode; a decode step computes its own row of the current chunk with the chunk computation's
arithmetic, from the rows of the partial chunk its slot holds. So a token gets the same bits whether
it is trained in a packed batch, prefilled in any chunking, or decoded; the conv keeps the W - 1 last
raw inputs. The states each sequence carries between calls, per layer (R = CHUNK - 1 rows), in this
order (the fp32 tensors first, so every tensor of a page starts aligned to its dtype):
    state  [HV, DV, DK]    fp32: the state at the last chunk boundary (the transpose of transformers')
    t      [R, HV, CHUNK]  fp32: the partial chunk's rows of T = (I + A)^-1
    g      [R, HV]         fp32: their gates
    beta   [R, HV]         fp32: their betas
    state_dt [HV, DV, DK]  the model dtype: the boundary state rounded (what the decode step's products read)
    conv   [W - 1, C]      the model dtype: the raw conv inputs (kernels.causal_conv1d's layout)
    k      [R, HK, DK]     the model dtype: their normalised keys
    x      [R, HV, DV]     the model dtype: their beta v
    vnew   [R, HV, DV]     the model dtype: their delta values V'
How many rows a slot holds is the sequence's context length mod CHUNK (`Sequences.context_lens`).
`state_shapes` / `state_dtypes` say so to the vLLM side, which allocates one slot of each per
sequence (vexact_vllm/state_cache.py) and hands them back in `Sequences.states`. Another design
changes this module only: its shapes, dtypes and kernel calls.

Differences from transformers (bounded by the accuracy tests, tests/model_patches/test_qwen3_5.py):
the conv's SiLU on the fp32 sum rounded once (transformers rounds the conv output first); the gates
and l2 norm of kernels/gated_delta/rules.py; chunks anchored at each sequence's start in decode too
(transformers' decode step is the recurrence; its chunked algorithm rounds differently); the gated norm rounds the normalised
row times the weight once and multiplies by silu(z) in fp32 (transformers rounds twice).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from vexact_vllm.kernels import (
    IncrementalCache,
    causal_conv1d,
    incremental_gated_delta_rule,
    incremental_gated_delta_rule_cached,
    silu_and_mul,
)
from vexact_vllm.kernels.gated_delta import incremental_cache

from .attention_context import AttentionContext, Sequences
from .config import DecoderConfig, LinearAttentionConfig
from .layers import Linear, RMSNorm, RotaryCache, gathered_linear, take_rows
from .tensor_parallel import TensorParallel, mark_shard


def state_shapes(linear: LinearAttentionConfig) -> tuple[tuple[int, ...], ...]:
    """The per-sequence state tensors of one Gated DeltaNet layer, in the module docstring's order."""
    hk, hv, dk, dv = linear.num_k_heads, linear.num_v_heads, linear.head_k_dim, linear.head_v_dim
    chunk = incremental_cache.CHUNK
    rows = chunk - 1
    return ((hv, dv, dk), (rows, hv, chunk), (rows, hv), (rows, hv), (hv, dv, dk),
            (linear.conv_kernel - 1, linear.conv_dim), (rows, hk, dk), (rows, hv, dv), (rows, hv, dv))  # fmt: skip


def state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """Their dtypes: the boundary state, T, the gates and betas fp32; the rounded state, the conv's raw
    inputs and the rows' keys, beta v and delta values in the model dtype."""
    return (torch.float32,) * 4 + (model_dtype,) * 5


class CausalConv1d(nn.Module):
    """`linear_attn.conv1d`: the depthwise conv's weight [C, 1, W] (nn.Conv1d's layout), no bias."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))

    def taps(self) -> torch.Tensor:
        return self.weight.squeeze(1)  # [C, W], a view


class GatedDeltaNet(nn.Module):
    """The layer's conv, gates, recurrence, gated norm and out_proj; a family subclass adds its input
    projections and `project`.

    With `tp` (tensor_parallel.py: column-parallel only) rank r holds key heads [r HK_r, (r + 1) HK_r)
    (HK_r = HK / T) and the value heads that read them, [r HV_r, (r + 1) HV_r): their projection rows,
    conv channels (q, k and v blocks), gates and recurrence, all per head or per channel, so each is the
    unsharded layer's arithmetic on those heads. `self.linear` is the rank's geometry (`shard`), which
    also sizes its states. The heads' outputs are gathered (rank order = head order), out_proj computes
    the rank's H / T columns from all of them, and those are gathered: no partial sum anywhere."""

    def __init__(self, config: DecoderConfig, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        whole = config.linear
        lin = self.linear = whole if tp is None else whole.shard(tp.size)
        self.tp, self.whole, self.layer_idx = tp, whole, layer_idx
        rank = 0 if tp is None else tp.rank
        self.k_first, self.v_first = rank * lin.num_k_heads, rank * lin.num_v_heads  # the rank's first heads
        self.conv1d = CausalConv1d(lin.conv_dim, lin.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(lin.num_v_heads))
        self.norm = RMSNorm(lin.head_v_dim, config.rms_norm_eps)  # the gated norm's weight (ones at init)
        self.out_proj = Linear(whole.num_v_heads * whole.head_v_dim, config.hidden_size, tp=tp)
        self.splits = (lin.num_k_heads * lin.head_k_dim, lin.num_k_heads * lin.head_k_dim,
                       lin.num_v_heads * lin.head_v_dim)  # fmt: skip
        if tp is not None:
            mark_shard(self.conv1d.weight, partial(take_rows, blocks=self.channel_blocks()))
            for p in (self.dt_bias, self.A_log):
                mark_shard(p, partial(take_rows, blocks=[self.v_heads(1)]))

    def v_heads(self, width: int) -> tuple[int, int]:
        """[start, stop) of the rank's value heads in a whole tensor of `width` rows per value head."""
        return self.v_first * width, (self.v_first + self.linear.num_v_heads) * width

    def channel_blocks(self) -> list[tuple[int, int]]:
        """The rank's conv channels in the whole layer's q | k | v order: its q, k and v heads' blocks."""
        w, lin = self.whole, self.linear
        k = (self.k_first * w.head_k_dim, (self.k_first + lin.num_k_heads) * w.head_k_dim)
        qk = w.num_k_heads * w.head_k_dim
        v = self.v_heads(w.head_v_dim)
        return [k, (qk + k[0], qk + k[1]), (2 * qk + v[0], 2 * qk + v[1])]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [T, C] in q | k | v channel order, z [T, HV, DV], b [T, HV], a [T, HV]): the family's."""
        raise NotImplementedError

    def forward(self, x, positions, rope: RotaryCache, attn: AttentionContext):
        t = x.shape[0]
        seqs = attn.sequences(self.layer_idx, t, x.device)
        n = t if seqs.num_tokens is None else seqs.num_tokens
        qkv, z, b, a = self.project(x[:n])
        o = self.mix(qkv, a.contiguous(), b.contiguous(), seqs)  # [n, HV, DV]
        normed = self.norm(o)  # rms_norm per v head, rounded once
        o = silu_and_mul(torch.cat([z, normed], dim=-1))  # silu(z) * normed in fp32, rounded once  [n, HV, DV]
        out = gathered_linear(self.out_proj, o.reshape(n, -1), self.tp)  # [n, H]
        if n == t:
            return out
        return torch.cat([out, out.new_zeros(t - n, out.shape[1])])  # padding rows: zeros

    def mix(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seqs: Sequences) -> torch.Tensor:
        """The conv and the recurrence over the call's sequences, from zero (training) or from each
        sequence's cached state, which is then updated (inference): o [n, HV, DV]."""
        if seqs.states is None:
            qkv = causal_conv1d(qkv, self.conv1d.taps(), None, seqs.cu_seqlens)  # [n, C]
            q, k, v = self._heads(qkv)
            return incremental_gated_delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, seqs.cu_seqlens)[0]
        # each slot contiguous, the slots at vLLM's page stride: the kernels take both
        state, t, g, beta, state_dt, conv, k_rows, x_rows, vnew = seqs.states
        cache = IncrementalCache(state=state, k=k_rows, x=x_rows, g=g, beta=beta, t=t, vnew=vnew, state_dt=state_dt)
        qkv = causal_conv1d(qkv, self.conv1d.taps(), None, seqs.cu_seqlens, conv, seqs.slots, seqs.has_state)
        q, k, v = self._heads(qkv)
        return incremental_gated_delta_rule_cached(
            q, k, v, a, b, self.A_log, self.dt_bias, seqs.cu_seqlens, cache, seqs.slots, seqs.has_state,
            seqs.context_lens, decode_only=seqs.decode_only, split=seqs.split,
        )  # fmt: skip

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, HK, DK], k [n, HK, DK], v [n, HV, DV]: views of the conv's output channels."""
        lin, n = self.linear, qkv.shape[0]
        q, k, v = qkv.split(self.splits, dim=-1)
        return (q.view(n, lin.num_k_heads, lin.head_k_dim), k.view(n, lin.num_k_heads, lin.head_k_dim),
                v.view(n, lin.num_v_heads, lin.head_v_dim))  # fmt: skip


def init_weights(module: GatedDeltaNet, std: float) -> None:
    """transformers' initialisation of the layer's own parameters (the projections are `Linear`s):
    conv taps ~ N(0, std), dt_bias 1, A_log = log(U(0.01, 16)), the gated norm's weight 1."""
    with torch.no_grad():
        module.conv1d.weight.normal_(0.0, std)
        module.dt_bias.fill_(1.0)
        module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log_())
