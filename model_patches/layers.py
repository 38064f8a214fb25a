"""The small vocabulary the shared model definitions are built from.

Every module here calls one op of `vexact_vllm.kernels` and holds parameters under Hugging Face's
names, so a checkpoint (or verl's weight sync) loads without renaming. Nothing here knows whether it
runs in vLLM or in a trainer: attention gets its keys and values from the `AttentionContext`.

The q/k/v and gate/up projections run as one GEMM each (`PackedLinear`), on both sides, so the GEMM
sees one weight shape [Nq + 2 Nkv, K] (or [2I, K]) and one launch configuration everywhere; the
parameters stay the separate Hugging Face ones. At inference `pack_projections` makes them row
views of one persistent tensor, so no concatenation happens per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from itertools import islice

import torch
from torch import nn

from vexact_vllm.kernels import (
    add_rms_norm,
    apply_rope,
    backend_for,
    linear,
    rms_norm,
    rope_cache,
    silu_and_mul,
)
from vexact_vllm.kernels.autograd_utils import backward_without_autocast
from vexact_vllm.kernels.gemm.linear import linear_grads

from .attention_context import AttentionContext
from .config import DecoderConfig
from .pipeline_parallel import PipelineStage, placed, stage_layers
from .tensor_parallel import TensorParallel, kv_heads, mark_shard


def take_rows(full: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """The rows [start, stop) of each block of a whole tensor, stacked in the blocks' order (a view for one)."""
    parts = [full.narrow(0, start, stop - start) for start, stop in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def gathered_linear(proj: Linear, x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """A layer vLLM runs row-parallel, run column-parallel (tensor_parallel.py): x, this rank's block of
    proj's input columns, gathered to the whole K; the rank's output columns computed; those gathered.
    The unsharded layer's output on every rank; proj(x) without tp."""
    if tp is None:
        return proj(x)
    full = tp.gather(x, proj.weight.shape[1])
    if torch.is_grad_enabled():
        return tp.gather(proj(full), proj.config_n)
    rows = math.prod(full.shape[:-1])  # the rank's columns straight into the exchange
    out = tp.gather_output(lambda block: proj(full.reshape(rows, -1), out=block), rows, proj.config_n, full)
    return out.view(*full.shape[:-1], proj.config_n)


class Linear(nn.Module):
    """y = x W^T (+ b) with the batch-invariant GEMM; weight [out, in] as in nn.Linear.

    With `tp`, the rank's block of the output columns (tensor_parallel.py): weight [out / T, in]
    (or the `rows` [start, stop) given, or several such blocks, stacked in their order), launched with
    the whole layer's configuration (`config_n` = out), so each column has the bits of the unsharded
    layer's."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TensorParallel | None = None,
        rows: tuple[int, int] | list[tuple[int, int]] | None = None,
    ):
        super().__init__()
        self.config_n = None if tp is None else out_features
        if tp is not None:
            blocks = rows if isinstance(rows, list) else [rows or tp.bounds(out_features)]
            out_features = sum(stop - start for start, stop in blocks)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if tp is not None:
            for p in (self.weight, self.bias):
                if p is not None:
                    mark_shard(p, partial(take_rows, blocks=blocks))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, config_n=self.config_n, out=out)


class PackedLinear(nn.Module):
    """Several `Linear` layers over the same input, computed as ONE GEMM:
        y = x [W_0; W_1; ...]^T (+ [b_0; b_1; ...])                        [..., N_0 + N_1 + ...]
    Columns a_i .. a_i + N_i of y (a_i = N_0 + ... + N_(i-1)) are part i's output, bitwise equal to
    `linear(x, W_i, b_i)`: output element (m, n) is one reduction over K whose order depends on K
    alone (kernels.gemm.linear), so stacking rows of W changes nothing but the launch shape (N, K).

    The parts are the PARENT's children under their Hugging Face names (`self_attn.q_proj`, ...);
    this module only refers to them (an unregistered tuple) and owns no parameter, buffer or
    state_dict entry. The stacked weight comes from one of two places:
    - unpacked (training, the default): `torch.cat` of the parts on every call, inside
      `_PackedLinearFunction`, which saves the input and the parts (not the stacked [N, K] copy)
      for the backward and stacks them again there; FSDP keeps the parts as separate parameters.
    - packed (inference, after `pack()`): one persistent [N, K] tensor (plain attribute) whose
      row blocks ARE the parts' parameters (`param.data` is a view of it), so no cat happens and
      in-place writes to a part (`param.copy_`, `param.data.uniform_()`) land in the packed rows.
      A call that needs a gradient still takes the cat path. If a part's parameter was replaced
      after packing (`param.data = ...`, `module.to(...)`), the call refuses: pack again.
    """

    def __init__(self, parts: Sequence[Linear]):
        super().__init__()
        if len({p.bias is None for p in parts}) != 1:
            raise ValueError("PackedLinear parts must all have a bias or all have none")
        self.parts = tuple(parts)  # a tuple is not registered: the parts keep their parent's names
        self.sizes = [p.weight.shape[0] for p in parts]  # N_i: y.split(self.sizes, -1) gives the parts
        # Tensor-parallel shards: the whole stacked layer's N (sum of the parts' config_n).
        sharded = [p.config_n for p in parts if p.config_n is not None]
        self.config_n = sum(sharded) if sharded else None
        self.packed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (W [N, K], b [N])
        self._packed_ptrs: tuple[int, ...] = ()  # each packed parameter's data_ptr, to detect replacement

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, packed={self.packed is not None}"

    def _params(self) -> list[nn.Parameter]:
        return [p.weight for p in self.parts] + [p.bias for p in self.parts if p.bias is not None]

    @property
    def is_packed(self) -> bool:
        """True while packed and every part's parameter still views the packed storage."""
        return self.packed is not None and tuple(p.data_ptr() for p in self._params()) == self._packed_ptrs

    def pack(self) -> None:
        """Allocate the packed weight (and bias) once, copy the parts in and re-point each part's
        parameter to its rows. Idempotent; packs again if a parameter was replaced since."""
        if self.is_packed:
            return
        weight = _pack_rows([p.weight for p in self.parts])
        bias = _pack_rows([p.bias for p in self.parts]) if self.parts[0].bias is not None else None
        self.packed = (weight, bias)
        self._packed_ptrs = tuple(p.data_ptr() for p in self._params())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., sum N_i]."""
        needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self._params())
        if self.packed is not None and not needs_grad:
            if not self.is_packed:
                raise RuntimeError(
                    "a packed projection's parameter was replaced after pack_projections() (param.data = "
                    "..., or module.to()); write weights in place (param.copy_) or call pack_projections again"
                )
            weight, bias = self.packed
            return linear(x, weight, bias, config_n=self.config_n)
        return _PackedLinearFunction.apply(x, len(self.parts), *self._params())


class _PackedLinearFunction(torch.autograd.Function):
    """linear(x, cat(W_i), cat(b_i)) whose backward keeps only x and the W_i (which FSDP or the
    module hold anyway): the stacked [N, K] weight lives for the forward GEMM, and again for dX.

    Forward: the shared `linear` (so the bits are the packed path's). Backward: `linear_grads`,
    the GEMM's own backward on the forward's backend: dX = dY . cat(W_i), dW = dY^T X split by
    rows into the parts, db = column sums of dY split likewise. Deterministic, not batch-invariant
    (rule 7). M = rows of x, N = sum N_i, K = in features."""

    @staticmethod
    def forward(ctx, x, n_parts: int, *params):  # params: W_0.. W_(n-1), then b_0.. b_(n-1) or none
        weights, biases = params[:n_parts], params[n_parts:]
        ctx.backend, ctx.n_parts = backend_for(x), n_parts
        ctx.sizes = [w.shape[0] for w in weights]
        ctx.bias_dtype = biases[0].dtype if biases else None
        ctx.save_for_backward(x, *weights)
        bias = torch.cat(biases) if biases else None  # [N]
        return linear(x, torch.cat(weights), bias)  # the [N, K] cat is freed on return

    @staticmethod
    @backward_without_autocast
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        n = ctx.n_parts
        needs = ctx.needs_input_grad
        need_x, need_w, need_b = needs[0], any(needs[2 : 2 + n]), any(needs[2 + n :])
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        weight = torch.cat(weights) if need_x else weights[0]  # [N, K]; dW needs no stacked weight
        grad_x, grad_w, grad_b = linear_grads(
            ctx.backend,
            grad_out.reshape(-1, grad_out.shape[-1]),
            x2,
            weight,
            ctx.bias_dtype,
            (need_x, need_w, need_b),
        )
        grads_w = grad_w.split(ctx.sizes) if grad_w is not None else [None] * n
        grads_b = grad_b.split(ctx.sizes) if grad_b is not None else [None] * (len(needs) - 2 - n)
        grad_x = grad_x.reshape(x.shape) if grad_x is not None else None
        return grad_x, None, *grads_w, *grads_b


def _pack_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor [sum rows, ...] holding the params' values; each param's data becomes its rows."""
    first = params[0]
    if any(
        p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:] for p in params
    ):
        raise ValueError("packed parameters must share dtype, device and trailing shape")
    packed = torch.empty(
        (sum(p.shape[0] for p in params), *first.shape[1:]), dtype=first.dtype, device=first.device
    )
    start = 0
    with torch.no_grad():
        for p in params:
            rows = packed[start : start + p.shape[0]]
            rows.copy_(p.data)
            p.data = rows
            start += p.shape[0]
    return packed


def pack_projections(module: nn.Module) -> None:
    """Inference: pack every `PackedLinear` inside `module` (see `PackedLinear.pack`). Call it once
    the model is built, before the weights load; names, shapes and state_dict keys stay the same."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            m.pack()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def scale(self) -> torch.Tensor:
        """What the normalised row is multiplied by: the weight itself."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the residual stream kept in the model dtype."""
        return add_rms_norm(x, residual, self.scale(), self.eps)


class ZeroCentredRMSNorm(RMSNorm):
    """Qwen3-Next's and Qwen3.5's RMSNorm: the weight is stored centred on 0 (initialised to zeros) and
    the row is multiplied by fp32(1 + fp32(weight)), transformers' `output * (1.0 + self.weight.float())`.
    The 1 + w is an exact-per-element fp32 add formed on every call, so a weight written in place (verl's
    sync) is seen at once, and the gradient reaches the weight through it."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.float()  # [H] fp32


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), elementwise in fp32, rounded once to x's dtype; sigmoid as 1 / (1 + exp(-g)),
    built from `exp` and a division like every kernel here (torch.sigmoid's CPU tail loop rounds
    differently from its vector body). Qwen3-Next's / Qwen3.5's attention output gate and the
    shared expert's gate. Elementwise: a row's bits do not depend on the batch."""
    return (x.float() / (1.0 + torch.exp(-gate.float()))).to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)  # a gather: exact


class RotaryCache:
    """cos|sin table [max_positions, rotary_dim] (fp32), built once per device, never a buffer, so
    meta-device construction and FSDP leave it alone. The layers receive this object, not the table:
    FSDP2 with `cast_forward_inputs` (VeOmni's and verl's mixed precision) casts every floating-point
    tensor argument of a wrapped layer to the parameter dtype, which would hand the rotation a bf16
    table."""

    def __init__(self, config: DecoderConfig):
        self.args = (config.rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = rope_cache(*self.args).to(device)
        return self._by_device[device]


class MLP(nn.Module):
    """SwiGLU MLP of `intermediate_size` (None: the config's; DeepSeek's shared experts have their
    own). With `tp`: the rank's I / T gate/up columns, the activation gathered, the rank's H / T
    down_proj columns, the output gathered (tensor_parallel.py)."""

    def __init__(self, config: DecoderConfig, tp: TensorParallel | None = None, intermediate_size: int | None = None):
        super().__init__()
        h, i, b = config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        self.tp = tp
        self.gate_proj = Linear(h, i, b, tp)
        self.up_proj = Linear(h, i, b, tp)
        self.gate_up_proj = PackedLinear([self.gate_proj, self.up_proj])
        self.down_proj = Linear(i, h, b, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate then up, as silu_and_mul takes them
        return gathered_linear(self.down_proj, silu_and_mul(gate_up), self.tp)  # [T, H]


class SelfAttention(nn.Module):
    """Grouped-query self-attention. T = tokens, Hq/Hkv = query/kv heads, D = head_dim.

    Family options come from the config: q/k/v bias (Qwen2, Llama attention_bias), o bias (Llama
    attention_bias), per-head q/k RMSNorm before RoPE (Qwen3).

    With `tp`: the rank's query heads and their kv heads (`num_heads`, `num_kv_heads` are the rank's),
    the heads' outputs gathered, the rank's H / T o_proj columns, the output gathered. The attention
    geometry the vLLM side caches: `num_heads`, `num_kv_heads`, `head_dim`, `value_head_dim` (D)."""

    def __init__(self, config: DecoderConfig, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.value_head_dim = self.head_dim
        self.scale = self.head_dim**-0.5
        h, q_size, kv_size = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        kv_rows = None
        if tp is not None:  # the rank's query heads, and the kv heads they use (split or replicated)
            first, self.num_kv_heads = kv_heads(config.num_heads, config.num_kv_heads, tp)
            self.num_heads //= tp.size
            kv_rows = (first * self.head_dim, (first + self.num_kv_heads) * self.head_dim)
        self.q_proj = Linear(h, q_size, config.qkv_bias, tp)
        self.k_proj = Linear(h, kv_size, config.qkv_bias, tp, kv_rows)
        self.v_proj = Linear(h, kv_size, config.qkv_bias, tp, kv_rows)
        self.qkv_proj = PackedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = Linear(q_size, h, config.o_bias, tp)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, positions, rope: RotaryCache, attn: AttentionContext):
        t = x.shape[0]
        # Views of one [T, Nq + 2 Nkv] GEMM output: rows strided, last dim contiguous, which every
        # op below accepts (the kernels check only the last dim; the torch ones copy where they
        # must, the Triton ones take strides).
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk_norm = None  # Qwen3: each head's RMSNorm, fused with the rotation (one kernel)
        if self.q_norm is not None:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = apply_rope(q, k, positions, rope.get(x.device), qk_norm)
        out = attn.attend(self.layer_idx, q, k, v, self.scale)  # [T, Hq, D]
        return gathered_linear(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), self.tp)  # [T, H]


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately so each norm fuses the add. The
    feed-forward block (`mlp`: the dense MLP, or a family's MoE block) and the attention block
    (`attention`: `SelfAttention` unless given, e.g. DeepSeek's MLA) are the family's choice."""

    def __init__(
        self,
        config: DecoderConfig,
        layer_idx: int,
        mlp: nn.Module,
        tp: TensorParallel | None = None,
        attention: nn.Module | None = None,
        norm: type[RMSNorm] = RMSNorm,
        mixer_name: str = "self_attn",
    ):
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        # The token mixer under its Hugging Face name: `self_attn`, or `linear_attn` (Gated DeltaNet).
        self.mixer_name = mixer_name
        setattr(self, mixer_name, attention if attention is not None else SelfAttention(config, layer_idx, tp))
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    @property
    def mixer(self) -> nn.Module:
        """The token mixer (attention or linear attention)."""
        return getattr(self, self.mixer_name)

    def forward(self, x, residual, positions, rope: RotaryCache, attn: AttentionContext):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.mixer(h, positions, rope, attn)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    """embed_tokens -> layers -> norm. Inputs are packed: input_ids [T], positions [T].

    A family file subclasses this and chooses each layer's feed-forward block in `mlp` and its
    attention block in `attention` (built with `self.tp`). `tp`: this rank of a tensor-parallel group
    (vLLM only; tensor_parallel.py); None in
    every trainer. `stage`: the layers and parts this pipeline stage builds (vLLM only;
    pipeline_parallel.py); the whole decoder by default, and in every trainer."""

    def __init__(
        self, config: DecoderConfig, tp: TensorParallel | None = None, stage: PipelineStage | None = None
    ):
        super().__init__()
        self.config, self.tp = config, tp
        self.stage = stage = stage or PipelineStage.whole(config.num_layers)
        self.embed_tokens = placed(
            stage.has_embedding(config.tie_word_embeddings),
            lambda: Embedding(config.vocab_size, config.hidden_size),
        )
        self.layers = stage_layers(stage, config.num_layers, lambda i: self.layer(config, i))
        self.norm = placed(stage.is_last, lambda: self.norm_class(config.hidden_size, config.rms_norm_eps))
        self.rotary = RotaryCache(config)

    # The hidden-state norms' class (each layer's two and the final one): zero-centred in Qwen3-Next / Qwen3.5.
    norm_class: type[RMSNorm] = RMSNorm

    def layer(self, config: DecoderConfig, layer_idx: int) -> DecoderLayer:
        """Layer `layer_idx`: its token mixer (`attention`), feed-forward block (`mlp`) and norms."""
        return DecoderLayer(config, layer_idx, self.mlp(config, layer_idx), self.tp, self.attention(config, layer_idx),
                            self.norm_class)  # fmt: skip

    def mlp(self, config: DecoderConfig, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block: the dense SwiGLU MLP unless a family says otherwise."""
        return MLP(config, self.tp)

    def attention(self, config: DecoderConfig, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s attention block: grouped-query `SelfAttention` unless a family says otherwise."""
        return SelfAttention(config, layer_idx, self.tp)

    # Gradient checkpointing: set by Hugging Face's `gradient_checkpointing_enable` (with the
    # checkpoint function in `_gradient_checkpointing_func`); training only. The recomputation runs
    # the same kernels on the same inputs, so it gives the same bits as the first forward.
    gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionContext,
        handed_over: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The normalised hidden states [T, H] (the whole decoder, the last pipeline stage); a stage
        before the last returns (x, residual) [T, H] each, which the next stage takes as `handed_over`
        in place of input_ids (pipeline_parallel.py: both, never their sum)."""
        stage = self.stage
        if stage.is_first:
            x, residual = self.embed_tokens(input_ids), None  # [T, H]
        else:
            x, residual = handed_over
        rope = self.rotary  # the object: see RotaryCache
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in islice(self.layers, stage.start, stage.stop):  # the stage's layers, no copy
            if checkpointing:
                x, residual = self._gradient_checkpointing_func(
                    layer.__call__, x, residual, positions, rope, attn
                )
            else:
                x, residual = layer(x, residual, positions, rope, attn)
        if not stage.is_last:
            return x, residual
        x, _ = self.norm.add(x, residual)
        return x  # [T, H]
