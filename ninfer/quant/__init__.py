"""Quantized-weight checkpoints: FP8 128x128 block scales (HF fine-grained) and NVFP4
(compressed-tensors and ModelOpt layouts). See config.py for what loads and what is refused."""
from ninfer.quant.apply import describe, finalize, quantize_modules
from ninfer.quant.config import SUPPORTED, UNUSED_SUFFIXES, QuantConfig, QuantConfigError, parse_quant_config
from ninfer.quant.linear import QuantLinear

__all__ = ["QuantConfig", "QuantConfigError", "QuantLinear", "SUPPORTED", "UNUSED_SUFFIXES", "describe", "finalize",
           "parse_quant_config", "quantize_modules"]
