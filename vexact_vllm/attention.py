"""vLLM attention backend for vexact models: the inference side of the shared attention core.

Each step writes the new keys and values into the paged cache first, then every query reads its
keys back from the cache, so cached (prefix-cache hits, earlier chunks, earlier decode steps) and new
keys go through one reduction: `kernels.paged_attention`, whose per-query order is anchored at
absolute position 0 exactly like the training kernel `kernels.varlen_attention`.

CUDA graphs: decode and mixed prefill/decode batches alike (the builder declares ALWAYS support and
the vexact model asks vLLM for FULL graphs, vllm_wrapper.py).

Shared prompts (opt-in, VEXACT_SHARED_PREFIX=1; CUDA): GRPO's samples of one prompt read the
prompt's cache blocks (vLLM's prefix cache gives them the same blocks). The builder groups the decode
requests whose block tables start alike (`kernels.shared_prefix_groups`, on the device, into
persistent buffers), and the kernel attends each group's common key tiles once for all its members
before each member's own tiles: the same bits, the prompt read once per group instead of per sample.
Off by default: on an H100 a grpo step's attention takes 13% less time with it, but a workload of
distinct prompts, where no group forms, runs slower with it on (`default` 0.985 of stock with the
groups against 1.022 without, `grpo:32` 0.921 against 0.877; see docs/results.md). The groups take
no key split: VEXACT_SHARED_PREFIX=1 needs VEXACT_KEY_SPLIT=0 (kernels/settings.py refuses it else).

Cache layouts (one tensor per layer, allocated by vLLM from the layer's `get_kv_cache_spec`):
- `VexactAttentionBackend`, vLLM's full-attention spec: the logical view [num_blocks, num_kv_heads,
  block_size, 2 * head_size], keys in the first head_size cells of the last axis, values in the rest.
- `VexactLatentAttentionBackend` (DeepSeek's MLA, model_patches/mla.py), vLLM's own MLA spec
  (`LatentAttention.get_kv_cache_spec`: `MLAAttentionSpec`, one "head" of kv_lora_rank +
  qk_rope_head_dim): the view [num_blocks, 1, block_size, C + Dr] holding per token the latent c and
  the rotary key, stock vLLM's bytes. The keys are the whole row; the values are its first C cells
  (the layer's head_size_v), a view of the same bytes: nothing is stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from vexact_vllm.kernels import (
    SharedPrefix,
    max_group_members,
    paged_attention,
    shared_prefix_groups,
    write_kv_cache,
)
from vexact_vllm.kernels.settings import get_settings

BACKEND_NAME = "CUSTOM"  # vLLM's registry slot for out-of-tree backends


class VexactAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True  # rule 3: write K/V, then attend, in one place
    values_in_keys: ClassVar[bool] = False  # the latent layout: values are the keys' first cells
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[VexactAttentionImpl]:
        return VexactAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[VexactAttentionMetadataBuilder]:
        return VexactAttentionMetadataBuilder

    @classmethod
    def get_kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        """vLLM <= 0.26 asks the backend for the per-layer cache shape (newer ones derive it from
        the KV cache spec and layout): the same [num_blocks, Hkv, block_size, row] view, a row holding
        the keys then the values (2 * head_size), or the latent row alone (head_size)."""
        return (num_blocks, num_kv_heads, block_size, head_size if cls.values_in_keys else 2 * head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any: the kernels take head_dim as data

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.LBHNC,)


class VexactLatentAttentionBackend(VexactAttentionBackend):
    """DeepSeek's MLA over vLLM's latent cache (`LatentAttention`): one key head of C + Dr per token,
    the values its first C cells."""

    values_in_keys: ClassVar[bool] = True


class LatentAttention(Attention):
    """vLLM's `Attention` layer over the latent cache (DeepSeek's MLA): num_heads query heads, one
    key head of head_size = C + Dr, values of head_size_v = C, served by `VexactLatentAttentionBackend`.
    Its spec is vLLM's own `MLAAttentionSpec` (stock's page: block x (C + Dr) elements, no separate V),
    where vLLM's `Attention` would declare a full-attention page of keys and values."""

    def get_kv_cache_spec(self, vllm_config):
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        return MLAAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.head_size,
            dtype=self.kv_cache_torch_dtype,
            cache_dtype_str=self.kv_cache_dtype,
        )


@dataclass
class VexactAttentionMetadata:
    num_actual_tokens: int  # rows of q that are real tokens (the rest is padding)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: keys per sequence after this step's tokens are written
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    shared: SharedPrefix | None = None  # decode groups reading the same prompt blocks (no value changes)
    max_query_len: int | None = None  # eager steps only (no graph replays them): sizes FA4's grid


class VexactAttentionMetadataBuilder(AttentionMetadataBuilder[VexactAttentionMetadata]):
    """Views of vLLM's common metadata, and on CUDA the shared-prompt groups (computed on the
    device), nothing computed on the host. Any batch can be captured in a CUDA graph (ALWAYS): the
    kernels read lengths, block tables and the groups on the device, their grids depend on the padded
    token and request counts only, padded requests have empty queries and padded tokens the slot -1
    (neither written nor stored)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Persistent: a CUDA graph captured with shared-prompt groups reads these addresses at every replay.
        capacity = padded_request_capacity(vllm_config)
        # Shared-prompt groups: at most as many members as one query tile has rows for (Hq / Hkv rows
        # a sequence: kernels.max_group_members).
        group = _query_heads_per_kv_head(vllm_config, kv_cache_spec)
        self._page = getattr(kv_cache_spec, "block_size", None)
        head_dim = getattr(kv_cache_spec, "head_size", None)
        shares = torch.device(device).type == "cuda" and get_settings().shared_prefix and group and self._page
        self._max_members = max_group_members(head_dim, group) if shares and head_dim else 0
        self._compilation = getattr(vllm_config, "compilation_config", None)  # read at each step (_eager_prefill)
        self._shared_buffers = (  # order, members, tiles, starts, count (SharedPrefix)
            tuple(torch.zeros(capacity, dtype=torch.int32, device=device) for _ in range(5))
            if self._max_members >= 2 else None
        )  # fmt: skip

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> VexactAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise ValueError("vexact attention is causal decoder attention only")
        query_start_loc, seq_lens = m.query_start_loc[: m.num_reqs + 1], m.seq_lens[: m.num_reqs]
        shared = None  # decided by the request count alone (eager prefills aside): capture and replays agree
        buffers = self._shared_buffers
        eager = self._eager_prefill(m)
        if buffers is not None and 2 <= m.num_reqs <= buffers[0].shape[0] and not eager:
            shared = shared_prefix_groups(
                m.block_table_tensor, seq_lens, query_start_loc, self._page, self._max_members, out=buffers
            )
        return VexactAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            shared=shared,
            max_query_len=m.max_query_len if eager else None,
        )

    def _eager_prefill(self, m) -> bool:
        """A step with a prefill chunk that no CUDA graph can replay: more tokens than the largest
        graph, or graphs off. No graph reads the groups' buffers then, so it may skip the grouping
        (and its launch a layer). Read from vLLM's live config at each step; with graphs on and their
        largest size unknown, no step counts as eager."""
        if m.max_query_len <= 1:
            return False
        mode = getattr(self._compilation, "cudagraph_mode", None)
        if mode is None or mode == CUDAGraphMode.NONE:
            return True
        largest = getattr(self._compilation, "max_cudagraph_capture_size", None)
        return largest is not None and m.num_actual_tokens > largest


def padded_request_capacity(vllm_config) -> int:
    """Rows of a builder's persistent per-request buffers: padded request counts stay within the tokens
    of a step, so max_num_seqs + max_num_batched_tokens bounds them."""
    scheduler = vllm_config.scheduler_config
    return scheduler.max_num_seqs + scheduler.max_num_batched_tokens


def _query_heads_per_kv_head(vllm_config, kv_cache_spec) -> int | None:
    """Hq / Hkv of this rank's attention layers, or None where the config does not say."""
    model_config = getattr(vllm_config, "model_config", None)
    n_kv = getattr(kv_cache_spec, "num_kv_heads", None)
    if model_config is None or not n_kv:
        return None
    n_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
    return n_heads // n_kv if n_heads % n_kv == 0 else None


def split_kv_cache(
    kv_cache: torch.Tensor, head_size: int, head_size_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value views [num_blocks, block_size, Hkv, D or Dv] of a layer's cache: of
    [num_blocks, Hkv, block_size, 2 * D] (`head_size_v` None: keys then values), or of the latent
    [num_blocks, 1, block_size, D] (`head_size_v` Dv < D: the values are the keys' first Dv cells)."""
    row = 2 * head_size if head_size_v is None else head_size
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != row or (head_size_v is not None and not 0 < head_size_v < row):
        raise ValueError(
            f"unexpected KV cache shape {tuple(kv_cache.shape)} for head sizes {head_size} (keys) and "
            f"{head_size_v or head_size} (values); this vLLM version's cache layout is not supported by vexact-vllm"
        )
    kv = kv_cache.transpose(1, 2)  # [num_blocks, block_size, Hkv, row]
    if head_size_v is None:
        return kv[..., :head_size], kv[..., head_size:]
    return kv, kv[..., :head_size_v]


class VexactAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap=None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        **extra,
    ):
        refused = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
        }
        for name, value in refused.items():
            if value:
                raise ValueError(f"vexact attention does not support {name}={value!r}")
        if kv_cache_dtype not in VexactAttentionBackend.supported_kv_cache_dtypes:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} cannot keep rollouts bitwise equal to the trainer; "
                "use --kv-cache-dtype auto with --model-impl vexact"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.attn_type = attn_type

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("vexact attention does not fuse output quantization")
        if attn_metadata is None:  # profiling / warm-up run without a cache
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        head_size_v = getattr(layer, "head_size_v", None) or self.head_size  # vLLM's Attention carries it
        latent = head_size_v != self.head_size  # `LatentAttention`: the values are the keys' first cells
        k_cache, v_cache = split_kv_cache(kv_cache, self.head_size, head_size_v if latent else None)
        keys = key[:n].view(n, self.num_kv_heads, self.head_size)
        values = keys[..., :head_size_v] if latent else value[:n]  # latent: the same cells, written once more
        write_kv_cache(keys, values, k_cache, v_cache, attn_metadata.slot_mapping)
        paged_attention(
            query[:n],
            k_cache,
            v_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            self.scale,
            out=output[:n].view(n, self.num_heads, head_size_v),  # written in place: no copy
            shared=attn_metadata.shared,
            max_query_len=attn_metadata.max_query_len,
        )
        output[n:].fill_(0)
        return output
