"""Batch-invariant kernels: one op a file, one public function per op, framework-free.

Each public function checks its inputs, then runs the implementation `dispatch.backend_for` picks:
the torch reference on CPU (and in reference mode), the Triton kernels on CUDA. Every reduction's
order depends only on its own row and absolute position (see each module's docstring).

One sub-package per op family, each op an `op.py` (checks, torch path, dispatch) and its
`op_triton.py` (kernels, launcher, autograd; `op_triton_bwd.py` for a long backward):
`attention/` (varlen, paged, shared-prefix decode, FA4), `gemm/` (the linear layer, its tiles, splits
and K slices, and the SiLU-and-mul between the MLP's GEMMs), `norms/` (RMSNorm, the rotary embedding
with its fused q/k norm), `moe/` (routing, the expert layout, the fused experts), `sampling/` (the
log-prob function, top-k and ranks, the logit rules, Gumbel-max sampling, truncation) and
`gated_delta/` (Gated DeltaNet's conv and recurrence). What every family uses stays here: checks,
dispatch, settings, reduction, capture, autograd_utils, mkl_vml; a family imports these, and what it
shares with another family (the MoE calls the GEMM, routing the log-softmax), with no import cycle
(tests/test_imports.py). The sub-packages' `__init__`s import nothing: the public names are this
module's, and importing one op does not import its family.
"""

from .attention.causal import paged_attention, varlen_attention, write_kv_cache
from .attention.prefix import SharedPrefix, max_group_members, shared_prefix_groups
from .attention.tiles import KEY_TILE
from .dispatch import (
    backend_for,
    disable_reference_mode,
    enable_reference_mode,
    is_reference_mode_enabled,
    reference_mode,
)
from .gated_delta.causal_conv1d import causal_conv1d
from .gated_delta.incremental import incremental_gated_delta_rule, incremental_gated_delta_rule_cached
from .gated_delta.incremental_cache import IncrementalCache
from .gemm.activation import silu_and_mul
from .gemm.head_linear import head_linear
from .gemm.linear import linear
from .mkl_vml import warm_up_vml
from .moe.experts import fused_moe
from .moe.routing import route, route_grouped
from .norms.rms_norm import add_rms_norm, rms_norm
from .norms.rope import apply_rope, rope_cache
from .sampling.logprob import TORCH_VOCAB_BLOCK, linear_token_log_probs, log_softmax, token_log_probs
from .sampling.logprob_topk import TokenScores, score_tokens, token_ranks, top_k_ids
from .sampling.sample import Sampled, gumbel_argmax, sample_tokens
from .sampling.truncation import truncation_threshold

# The torch path's log-softmax block, under the name this package has always exported.
VOCAB_BLOCK = TORCH_VOCAB_BLOCK

warm_up_vml()  # before any parallel CPU op of ours can race on MKL's lazy dispatch (see mkl_vml.py)

__all__ = [
    "IncrementalCache",
    "KEY_TILE",
    "TORCH_VOCAB_BLOCK",
    "VOCAB_BLOCK",
    "add_rms_norm",
    "apply_rope",
    "backend_for",
    "causal_conv1d",
    "disable_reference_mode",
    "enable_reference_mode",
    "fused_moe",
    "gumbel_argmax",
    "is_reference_mode_enabled",
    "head_linear",
    "incremental_gated_delta_rule",
    "incremental_gated_delta_rule_cached",
    "linear",
    "linear_token_log_probs",
    "log_softmax",
    "max_group_members",
    "shared_prefix_groups",
    "SharedPrefix",
    "paged_attention",
    "reference_mode",
    "rms_norm",
    "rope_cache",
    "route",
    "route_grouped",
    "Sampled",
    "sample_tokens",
    "score_tokens",
    "silu_and_mul",
    "token_log_probs",
    "token_ranks",
    "TokenScores",
    "top_k_ids",
    "truncation_threshold",
    "varlen_attention",
    "write_kv_cache",
]
