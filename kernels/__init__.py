"""Batch-invariant kernels: one op a file, one public function per op, framework-free.

Each public function checks its inputs, then runs the implementation `dispatch.backend_for` picks:
the torch reference on CPU (and in reference mode), the Triton kernels on CUDA. Every reduction's
order depends only on its own row and absolute position (see each module's docstring).
"""

from .activation import silu_and_mul
from .attention import paged_attention, varlen_attention, write_kv_cache
from .attention_prefix import SharedPrefix, max_group_members, shared_prefix_groups
from .attention_tiles import KEY_TILE
from .causal_conv1d import causal_conv1d
from .dispatch import (
    backend_for,
    disable_reference_mode,
    enable_reference_mode,
    is_reference_mode_enabled,
    reference_mode,
)
from .gated_delta import gated_delta_rule, gated_delta_rule_cached
from .gemm import linear
from .logprob import TORCH_VOCAB_BLOCK, linear_token_log_probs, log_softmax, token_log_probs
from .logprob_topk import TokenScores, score_tokens, token_ranks, top_k_ids
from .mkl_vml import warm_up_vml
from .moe import fused_moe
from .moe_routing import route, route_grouped
from .rms_norm import add_rms_norm, rms_norm
from .rope import apply_rope, rope_cache
from .sample import Sampled, gumbel_argmax, sample_tokens
from .truncation import truncation_threshold

# The torch path's log-softmax block, under the name this package has always exported.
VOCAB_BLOCK = TORCH_VOCAB_BLOCK

warm_up_vml()  # before any parallel CPU op of ours can race on MKL's lazy dispatch (see mkl_vml.py)

__all__ = [
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
    "gated_delta_rule",
    "gated_delta_rule_cached",
    "gumbel_argmax",
    "is_reference_mode_enabled",
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
