"""vLLM's side of the state layers (Gated DeltaNet, model_patches/gated_delta.py): where each sequence's
states live between steps, and what a step tells the layer.

A vexact hybrid model (Qwen3-Next, Qwen3.5) builds one `GatedDeltaStateLayer` per Gated DeltaNet layer
it owns, a vLLM state layer (`MambaBase`) registered in vLLM's forward context under
`model.layers.{i}.linear_attn.state`. It declares vLLM's own spec for state layers (`MambaSpec`) with
the shapes and dtypes `gated_delta.state_shapes` / `state_dtypes` give, so vLLM's hybrid cache
allocates one slot of each state per running request beside the ordinary paged KV cache of the full
attention layers, and binds them to the layer (`kv_cache`). Its backend, `VexactStateBackend`, builds
per step from vLLM's common metadata, on the device and with no host sync, into persistent buffers
(a CUDA graph replays the addresses it captured):
    cu_seqlens    [N + 1]  the step's rows per request (query_start_loc)
    slots         [N]      each request's state slot (the first block of its state block table); -1 for
                           a request with no rows (a CUDA graph's padding), whose state the kernels
                           neither read nor write
    context_lens  [N]      tokens the request's state already holds (seq_len - query_len)
    has_state     [N]      context_lens > 0: False where a request starts in this step, from a zero
                           state, including a request preempted and recomputed from its prompt
    decode_only            every request has one row (the kernels then read nothing on the host)
    split                  otherwise, how the step's rows go to the kernels (`StepSplit`), worked out
                           once a step from vLLM's host copies of the lengths, so that no layer reads
                           the host
and the model's context hands it to the layer as `attention_context.Sequences`. CUDA graphs: decode
steps only (the builder declares UNIFORM_SINGLE_TOKEN_DECODE and the model asks for FULL_DECODE_ONLY,
vllm_wrapper.py): a step with prefill rows reads how its rows split between the kernels on the host.

Prefix caching is refused for these models (engine_checks.py): vLLM's "align" mode for state layers
copies states between blocks with copy functions and chunk boundaries of its own, which vexact-vllm
has not made exact yet. Without it each request owns one state slot (vLLM's mamba cache mode "none").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from vexact_vllm.attention import padded_request_capacity
from vexact_vllm.kernels.gated_delta.incremental_cache import StepSplit, split_step
from vexact_vllm.model_patches.attention_context import Sequences
from vexact_vllm.model_patches.config import LinearAttentionConfig
from vexact_vllm.model_patches.gated_delta import state_dtypes, state_shapes

STATE_LAYER_SUFFIX = "linear_attn.state"  # `model.layers.{i}.linear_attn.state` in vLLM's forward context


@dataclass
class VexactStateMetadata:
    num_actual_tokens: int  # rows of the step that are tokens
    cu_seqlens: torch.Tensor  # int32 [N + 1]
    slots: torch.Tensor  # int32 [N]
    context_lens: torch.Tensor  # int32 [N]
    has_state: torch.Tensor  # bool [N]
    decode_only: bool  # one row a request (max_query_len 1): the kernels read nothing on the host
    split: StepSplit | None  # the rows' kernels of a step that is not decode_only (host lengths, one copy)


class VexactStateMetadataBuilder(AttentionMetadataBuilder[VexactStateMetadata]):
    """Views and elementwise device ops of vLLM's common metadata (module docstring); decode steps may be
    captured in a CUDA graph: the kernels read lengths and slots on the device."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Persistent: a CUDA graph reads the addresses it was captured with at every replay, so what the
        # builder computes goes into these (vLLM's own metadata tensors are persistent already).
        capacity = padded_request_capacity(vllm_config)
        self._slots = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._context = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._has_state = torch.zeros(capacity, dtype=torch.bool, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> VexactStateMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        cu = m.query_start_loc[: n + 1]
        slots, context, has_state = self._slots[:n], self._context[:n], self._has_state[:n]
        query_lens = cu[1:] - cu[:-1]
        # A request with no rows is a CUDA graph's padding: slot -1, its (stale) block table row unread.
        slots.copy_(m.block_table_tensor[:n, 0]).masked_fill_(query_lens == 0, -1)
        torch.sub(m.seq_lens[:n], query_lens, out=context)
        torch.gt(context, 0, out=has_state)
        decode_only = m.max_query_len == 1
        split = None
        if not decode_only:  # from the host lengths vLLM keeps (exact outside speculative decoding)
            cu_cpu = m.query_start_loc_cpu[: n + 1].long()
            seq_lens_cpu = m.seq_lens_cpu_upper_bound
            seq_lens_cpu = m.seq_lens[:n].cpu() if seq_lens_cpu is None else seq_lens_cpu[:n]
            context_cpu = seq_lens_cpu.long() - (cu_cpu[1:] - cu_cpu[:-1])
            split = split_step(cu_cpu, context_cpu, context_cpu > 0, self.device)
        return VexactStateMetadata(
            num_actual_tokens=m.num_actual_tokens,
            cu_seqlens=cu,
            slots=slots,
            context_lens=context,
            has_state=has_state,
            decode_only=decode_only,
            split=split,
        )


class VexactStateBackend(AttentionBackend):
    """The state layers' backend: metadata only (the layer runs the kernels itself)."""

    @staticmethod
    def get_name() -> str:
        return "VEXACT_STATE"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("vexact state layers run their kernels themselves (model_patches/gated_delta.py)")

    @staticmethod
    def get_builder_cls() -> type[VexactStateMetadataBuilder]:
        return VexactStateMetadataBuilder

    @classmethod
    def is_ssm(cls) -> bool:
        return True

    @staticmethod
    def get_kv_cache_shape(*args, **kwargs):
        raise NotImplementedError("state layers are shaped by their MambaSpec")


class GatedDeltaStateLayer(nn.Module, MambaBase):
    """One Gated DeltaNet layer's state slots in vLLM's hybrid cache (module docstring). No parameters;
    never called: the model's context reads its states and this step's metadata (`sequences`)."""

    def __init__(self, linear: LinearAttentionConfig, model_dtype: torch.dtype, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.prefix, self.linear, self.model_dtype = prefix, linear, model_dtype
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix} in vLLM's forward context")
        context[prefix] = self

    def get_state_shape(self):
        return state_shapes(self.linear)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return state_dtypes(self.model_dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_attn_backend(self) -> type[AttentionBackend]:
        return VexactStateBackend

    def states(self) -> tuple[torch.Tensor, ...]:
        """The bound state tensors, [slots, *shape] each (vLLM 0.32 binds a tuple; 0.26 a list per virtual
        engine whose first entry is that tuple)."""
        cache = self.kv_cache
        if len(cache) == 1 and isinstance(cache[0], (list, tuple)):
            cache = cache[0]
        return tuple(cache)

    def sequences(self, num_rows: int, device: torch.device) -> Sequences:
        """This step's `Sequences` for the layer; outside a step with metadata (vLLM's profile and warm-up
        runs) the `num_rows` rows as one sequence from a zero state, no cache touched."""
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batches: one dict each
            metadata = metadata[0]
        m = None if metadata is None else metadata.get(self.prefix)
        if m is None:
            return Sequences(torch.tensor([0, num_rows], dtype=torch.int32, device=device))
        return Sequences(m.cu_seqlens, m.num_actual_tokens, self.states(), m.slots, m.has_state, m.context_lens,
                         m.decode_only, m.split)  # fmt: skip
