"""Pipeline parallelism that keeps the trainer's bits: whole layers per stage, both residual streams handed over.

Legend: S stages, s this stage, L layers, T tokens, H hidden size.

Rule: stage s builds the layers [start, stop) of the global numbering, whole, and runs each one on
the same inputs with the same kernels as the unsplit decoder (FSDP, one device) does, so no
reduction changes anywhere; between stages tensors are only copied. What a stage builds:
    embed_tokens   the first stage (it embeds the input ids), and the last one too when the lm_head is
                   tied to it (the lm_head reads its weight, loaded there from the same checkpoint tensor)
    layers         [start, stop) under their global index (`model.layers.{i}`), the others `MissingLayer`
    norm, lm_head  the last stage (it normalises, computes the logits and samples)
Every part a stage does not build is a `MissingLayer` under the part's own name, so the parameter
names of the parts it builds are the unsplit model's, and a loader skips exactly the checkpoint
tensors under a missing part's name (`missing_prefixes`).

What crosses from stage s to s + 1 (`HANDED_OVER`): the hidden states x AND the residual stream r,
both [T, H] in the model dtype. The decoder carries r beside x and fuses the add into the next
norm (`RMSNorm.add` -> `add_rms_norm(x, r)`, layers.py), so stage s + 1's first layer runs
`add_rms_norm(x, r)` on the very tensors layer `start` of the unsplit decoder gets: the same op on
the same inputs. Handing over one sum instead would make that layer run another path than the
unsplit decoder does (the add outside the fused kernel, then an add of zero or the first layer's
branch), which the contract does not allow even where it happens to round alike.

Every stage must own at least one layer: the first stage's first layer starts the residual stream
(r = the embeddings), and a stage with no layer would only copy. vLLM picks the bounds
(`get_pp_indices`, with `VLLM_PP_LAYER_PARTITION` overriding its even split); this module checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .config import UnsupportedModelError

# The tensors stage s hands to stage s + 1, by the names vLLM's IntermediateTensors carry.
HANDED_OVER = ("hidden_states", "residual")


@dataclass(frozen=True)
class PipelineStage:
    """This stage's place in the pipeline and its layers [start, stop) of the global numbering."""

    rank: int
    size: int
    start: int
    stop: int

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"pipeline rank {self.rank} outside [0, {self.size})")
        if not 0 <= self.start < self.stop:
            raise UnsupportedModelError(
                f"pipeline stage {self.rank} of {self.size} would own layers [{self.start}, {self.stop}): no "
                "layer. Every stage must own at least one layer: use a pipeline-parallel size no larger than "
                "num_hidden_layers, and give every stage a layer in VLLM_PP_LAYER_PARTITION"
            )

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """The unsplit decoder: one stage with every layer (the trainer's, and vLLM's without PP)."""
        return cls(0, 1, 0, num_layers)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, layer_idx: int) -> bool:
        return self.start <= layer_idx < self.stop

    def has_embedding(self, tied: bool) -> bool:
        """The first stage embeds; the last reads the embedding as its lm_head when they are tied."""
        return self.is_first or (tied and self.is_last)


def pipeline_stages(
    num_layers: int, size: int, bounds: Callable[[int, int, int], tuple[int, int]]
) -> list[PipelineStage]:
    """Every stage of a `size`-stage pipeline, `bounds(num_layers, rank, size)` giving each one's
    [start, stop) (vLLM's `get_pp_indices`); refuses bounds that skip, repeat or leave out a layer."""
    stages = [PipelineStage(r, size, *bounds(num_layers, r, size)) for r in range(size)]
    if [s.start for s in stages] != [0] + [s.stop for s in stages[:-1]] or stages[-1].stop != num_layers:
        spans = ", ".join(f"[{s.start}, {s.stop})" for s in stages)
        raise UnsupportedModelError(
            f"the pipeline stages' layers {spans} do not cover the {num_layers} layers once each, in order"
        )
    return stages


class MissingLayer(nn.Module):
    """The place of a part another stage builds: no parameter, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this pipeline stage does not hold this part of the model (another stage runs it)")


def placed(present: bool, build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` on the stage that holds the part, a `MissingLayer` in its place elsewhere."""
    return build() if present else MissingLayer()


def stage_layers(stage: PipelineStage, num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """[build(i) for the stage's layers, MissingLayer for the others], indexed by the global layer number."""
    return nn.ModuleList(placed(stage.owns(i), lambda i=i: build(i)) for i in range(num_layers))


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of `model`'s missing parts, each ending in "." (a tensor named under one
    belongs to another stage)."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, MissingLayer))
