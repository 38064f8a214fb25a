"""One model definition per family; `build_decoder` picks it from the config's model_type."""

from ..config import DecoderConfig
from ..layers import DecoderModel
from .llama import LlamaModel
from .qwen2 import Qwen2Model
from .qwen3 import Qwen3Model

MODEL_DEFINITIONS: dict[str, type[DecoderModel]] = {
    cls.model_type: cls for cls in (Qwen3Model, Qwen2Model, LlamaModel)
}


def build_decoder(config: DecoderConfig) -> DecoderModel:
    return MODEL_DEFINITIONS[config.model_type](config)
