"""One model definition per family (a file here: its `Model` and `decoder_fields`, plus a row of
families.py); `build_decoder` picks it from the config's model_type."""

from ..config import DecoderConfig
from ..families import BY_MODEL_TYPE
from ..layers import DecoderModel


def build_decoder(config: DecoderConfig) -> DecoderModel:
    return BY_MODEL_TYPE[config.model_type].decoder_class()(config)
