"""The mixture-of-experts blocks of the shared vocabulary: `SparseMoeBlock` (Qwen3-MoE's `mlp` on its sparse
layers) and `SharedExpertsMoeBlock` (DeepSeek-V2/V3's: routed experts plus always-on shared experts).

Parameters carry Hugging Face transformers 5's in-memory names and layouts (what its Qwen3-MoE
holds after loading a checkpoint, what VeOmni's Qwen3-MoE holds, what a trainer's state_dict and
verl's weight sync name), so checkpoints and weight sync load unchanged:
    mlp.gate.weight                [E, H]      the router
    mlp.experts.gate_up_proj       [E, 2I, H]  expert e's gate rows, then its up rows
    mlp.experts.down_proj          [E, H, I]
Checkpoints on disk name each expert (`mlp.experts.{e}.gate_proj.weight` ...): transformers converts
them on load (and back on save); the vLLM model's `load_weights` takes both forms.

Math (T = tokens, H = hidden, E = experts, k = experts per token, I = expert intermediate size):
    logits = linear(x, gate.weight) in fp32                     the shared GEMM, fp32 out  [T, E]
    (w, ids) = kernels.route(logits, k, norm_topk_prob)         fp32 softmax, top-k with the lower id
                                                                first on ties, renormalised in slot order
    out = kernels.fused_moe(x, gate_up_proj, down_proj, ids, w) per slot: the expert's SwiGLU MLP, the
                                                                k results summed in slot order in fp32,
                                                                rounded once                [T, H]
Every step is row-wise with a fixed reduction order, so a token's output does not depend on which
other tokens share the batch or how many reach an expert (DESIGN rule 6). Differences from Hugging
Face's Qwen3-MoE (which the contract forbids, or which are free): HF computes the router logits in
the model dtype before its fp32 softmax, rounds the routing weights to the model dtype, multiplies
each expert's bf16 output by them in bf16 and accumulates with `index_add_` in bf16 in expert order;
here the logits are fp32 out of the GEMM, the weights stay fp32 and the k products are summed in fp32
in slot order, rounded once.

DeepSeek's block (`SharedExpertsMoeBlock`), with names `mlp.gate.e_score_correction_bias` [E] (fp32, a
buffer: V3's router only) and `mlp.shared_experts.{gate,up,down}_proj.weight` besides the above:
    (w, ids) = kernels.route_grouped(logits, bias, ...)      sigmoid routing (V3), or
               kernels.route(logits, k, False) * scaling      softmax greedy routing (V2)
    out = fused_moe(x, ..., ids, w) + shared_experts(x)       the routed sum rounded once to the model
                                                              dtype, then ONE add of the shared experts'
                                                              output (a SwiGLU MLP), in that order
transformers adds the same two terms in the same order (`experts(...) + shared_experts(residuals)`);
its routed term is the bf16 index_add_ of the experts' bf16 outputs times their weights.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vexact_vllm.kernels import linear
from vexact_vllm.kernels.moe.experts import fused_moe, fused_moe_sharded
from vexact_vllm.kernels.moe.routing import route, route_grouped

from .config import DecoderConfig, UnsupportedModelError
from .layers import MLP, Linear, sigmoid_gate
from .tensor_parallel import TensorParallel, mark_shard


class Router(nn.Module):
    """`mlp.gate`: fp32 router logits [T, E] from the shared GEMM. With `correction_bias` (DeepSeek-V3)
    it also holds `e_score_correction_bias` [E], an fp32 buffer whatever the model dtype (as in
    transformers)."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):
        """`Module.to`, `.cuda()`, `.bfloat16()`...: the correction bias follows the device, never the
        dtype (transformers keeps it in fp32 the same way, `_keep_in_fp32_modules_strict`)."""
        bias = self.e_score_correction_bias
        out = super()._apply(fn, recurse)
        if bias is not None:
            self._buffers["e_score_correction_bias"] = bias.to(device=self.e_score_correction_bias.device)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, out_dtype=torch.float32)  # [T, E] fp32


class Experts(nn.Module):
    """`mlp.experts`: every expert's gate/up and down weights, stacked. With `tp` (tensor_parallel.py)
    the rank's block of each expert's gate rows and of its up rows [E, 2 I_r, H] and of its output
    rows [E, H_r, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp, self.sizes = tp, (intermediate_size, hidden_size)
        inter, hidden = intermediate_size, hidden_size
        if tp is not None:
            inter, hidden = (b - a for a, b in (tp.bounds(intermediate_size), tp.bounds(hidden_size)))
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate_size))
        if tp is not None:
            mark_shard(self.gate_up_proj, lambda full: tp.take_halves(full, 1), tp.take)
            mark_shard(self.down_proj, lambda full: tp.take(full, 1), tp.take)

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] for x [T, H] and the routing (ids, weights [T, k]); with
        `tp` each rank's expert columns, the activation and the output gathered (tensor_parallel.py)."""
        if self.tp is None:
            return fused_moe(x, self.gate_up_proj, self.down_proj, ids, weights)
        inter, hidden = self.sizes
        out = fused_moe_sharded(x, self.gate_up_proj, self.down_proj, ids, weights, lambda a: self.tp.gather(a, inter),
                                inter, hidden)  # fmt: skip
        return self.tp.gather(out, hidden)


class SparseMoeBlock(nn.Module):
    """Router + experts (see the module docstring). Forward hooks on `gate` see the router logits
    (the trainer's auxiliary load-balancing loss reads them there)."""

    def __init__(self, config: DecoderConfig, tp: TensorParallel | None = None):
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Router(moe.num_experts, config.hidden_size)  # replicated: routing on the full x
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E] fp32
        weights, ids = route(logits, self.top_k, self.norm_topk_prob)  # [T, k] fp32, [T, k] int64
        return self.experts.routed(x, ids, weights)  # [T, H]


# Checkpoints on disk (and verl's weight sync, which unfuses the experts) name each expert's tensors.
_EXPERT_TENSOR = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
# Each stacked parameter (the last part of its name) and the per-expert parts it holds, in row order.
STACKED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_tensor(name: str) -> tuple[str, int, str] | None:
    """`<layer>.mlp.experts.{e}.{gate|up|down}_proj.weight` -> (the stacked parameter's name, e, part);
    None for any other name."""
    m = _EXPERT_TENSOR.match(name)
    if m is None:
        return None
    stacked = next(key for key, parts in STACKED_PARTS.items() if m["part"] in parts)
    return f"{m['base']}.{stacked}", int(m["expert"]), m["part"]


def expert_rows(stacked: torch.Tensor, expert: int, part: str) -> torch.Tensor:
    """The view of a stacked parameter that holds expert `expert`'s `part` ([I, H] or [H, I])."""
    if part == "down_proj":
        return stacked[expert]
    half = stacked.shape[1] // 2
    return stacked[expert, :half] if part == "gate_proj" else stacked[expert, half:]


class SharedExpertsMoeBlock(nn.Module):
    """DeepSeek-V2/V3's MoE block: router + routed experts + shared experts (module docstring). With `tp`
    the experts and the shared experts are sharded as `SparseMoeBlock`'s and `MLP`'s; routing runs on
    the full x on every rank."""

    def __init__(self, config: DecoderConfig, tp: TensorParallel | None = None):
        super().__init__()
        moe = self.moe = config.moe
        self.gate = Router(moe.num_experts, config.hidden_size, moe.correction_bias)
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.intermediate_size, tp)
        self.shared_experts = MLP(config, tp, moe.shared_intermediate_size) if moe.shared_intermediate_size else None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [T, k], ids int64 [T, k]) of the router's fp32 logits [T, E]."""
        moe = self.moe
        if moe.scoring == "sigmoid":
            bias = self.gate.e_score_correction_bias
            if bias is None:
                bias = torch.zeros(moe.num_experts, dtype=torch.float32, device=logits.device)
            return route_grouped(logits, bias, moe.top_k, moe.n_group, moe.topk_group, moe.norm_topk_prob,
                                 moe.routed_scaling_factor)  # fmt: skip
        weights, ids = route(logits, moe.top_k, moe.norm_topk_prob)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(self.gate(x))  # [T, k] fp32, [T, k] int64
        out = self.experts.routed(x, ids, weights)  # [T, H]
        if self.shared_experts is None:
            return out
        return out + self.shared_experts(x)  # [T, H]: one add, routed + shared


def check_expert_tensors(names: set[str], config: DecoderConfig) -> None:
    """A checkpoint that names experts one by one must hold every expert's three tensors on every
    sparse layer; the first one missing is named (stacked `gate_up_proj`/`down_proj` also do)."""
    for layer in config.moe.sparse_layers:
        base = f"model.layers.{layer}.mlp.experts"
        if f"{base}.gate_up_proj" in names and f"{base}.down_proj" in names:
            continue
        for expert in range(config.moe.num_experts):
            for part in EXPERT_PARTS:
                name = f"{base}.{expert}.{part}.weight"
                if name not in names:
                    raise UnsupportedModelError(
                        f"the checkpoint has no {name}: expert {expert} of layer {layer} is missing its "
                        f"{part} (config.json says {config.moe.num_experts} experts); the checkpoint is incomplete"
                    )


class GatedSharedExpertMoeBlock(nn.Module):
    """Qwen3-Next's and Qwen3.5-MoE's MoE block: the softmax router and routed experts of `SparseMoeBlock`
    plus one shared expert (`mlp.shared_expert`, a SwiGLU MLP of shared_intermediate_size) whose output
    is scaled by a per-token sigmoid gate (`mlp.shared_expert_gate.weight` [1, H]):
        out = fused_moe(x, ...) + sigmoid(shared_expert_gate(x)) * shared_expert(x)
    the gate logit rounded to the model dtype (transformers' Linear), the product in fp32 rounded once
    (layers.sigmoid_gate; transformers rounds the sigmoid first), then one add in the model dtype in
    transformers' order (routed + shared). With `tp` the experts and the shared expert are sharded as
    `SparseMoeBlock`'s and `MLP`'s; the router and the shared expert's gate run on the full x on every rank."""

    def __init__(self, config: DecoderConfig, tp: TensorParallel | None = None):
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Router(moe.num_experts, config.hidden_size)
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.intermediate_size, tp)
        self.shared_expert = MLP(config, tp, moe.shared_intermediate_size)
        self.shared_expert_gate = Linear(config.hidden_size, 1)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)  # [T, k] fp32, [T, k] int64
        routed = self.experts.routed(x, ids, weights)  # [T, H]
        shared = sigmoid_gate(self.shared_expert(x), self.shared_expert_gate(x))  # [T, H] * [T, 1]
        return routed + shared
