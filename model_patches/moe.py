"""The mixture-of-experts block of the shared vocabulary (Qwen3-MoE's `mlp` on its sparse layers).

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
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vexact_vllm.kernels import linear
from vexact_vllm.kernels.moe import fused_moe, fused_moe_sharded
from vexact_vllm.kernels.moe_routing import route

from .config import DecoderConfig
from .tensor_parallel import TensorParallel, mark_shard


class Router(nn.Module):
    """`mlp.gate`: fp32 router logits [T, E] from the shared GEMM."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, out_dtype=torch.float32)  # [T, E] fp32


class Experts(nn.Module):
    """`mlp.experts`: every expert's gate/up and down weights, stacked. With `tp` (tensor_parallel.py)
    the rank's block of each expert's gate rows and of its up rows [E, 2 I_r, H] and of its output
    rows [E, H_r, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel | None = None):
        super().__init__()
        inter, hidden = intermediate_size, hidden_size
        if tp is not None:
            inter, hidden = (b - a for a, b in (tp.bounds(intermediate_size), tp.bounds(hidden_size)))
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate_size))
        if tp is not None:
            mark_shard(self.gate_up_proj, lambda full: tp.take_halves(full, 1), tp.take)
            mark_shard(self.down_proj, lambda full: tp.take(full, 1), tp.take)


class SparseMoeBlock(nn.Module):
    """Router + experts (see the module docstring). Forward hooks on `gate` see the router logits
    (the trainer's auxiliary load-balancing loss reads them there)."""

    def __init__(self, config: DecoderConfig, tp: TensorParallel | None = None):
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob, self.tp = moe.top_k, moe.norm_topk_prob, tp
        self.sizes = (moe.intermediate_size, config.hidden_size)
        self.gate = Router(moe.num_experts, config.hidden_size)  # replicated: routing on the full x
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [T, E] fp32
        weights, ids = route(logits, self.top_k, self.norm_topk_prob)  # [T, k] fp32, [T, k] int64
        w_gate_up, w_down = self.experts.gate_up_proj, self.experts.down_proj
        if self.tp is None:
            return fused_moe(x, w_gate_up, w_down, ids, weights)  # [T, H]
        inter, hidden = self.sizes
        out = fused_moe_sharded(x, w_gate_up, w_down, ids, weights, lambda a: self.tp.gather(a, inter), inter, hidden)
        return self.tp.gather(out, hidden)  # [T, H]


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
