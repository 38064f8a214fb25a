"""One model definition per family (a file here: its decoder class, a subclass of `layers.Decoder`, and
`decoder_fields`, plus a row of families.py); `build_decoder` picks it from the config's model_type."""

from ..config import DecoderConfig
from ..families import BY_MODEL_TYPE
from ..layers import Decoder
from ..pipeline_parallel import PipelineStage
from ..tensor_parallel import TensorParallel


def build_decoder(
    config: DecoderConfig, tp: TensorParallel | None = None, stage: PipelineStage | None = None
) -> Decoder:
    """The family's decoder; `tp`: this rank's shard of it (vLLM with --tensor-parallel-size > 1);
    `stage`: the part this pipeline stage builds (vLLM with --pipeline-parallel-size > 1)."""
    return BY_MODEL_TYPE[config.model_type].decoder_class()(config, tp, stage)
