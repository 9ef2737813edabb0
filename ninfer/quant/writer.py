"""Writing quantized checkpoints from dense weights (ninfer/tools/random_checkpoint.py --quant):
the config entry of each layout, which tensors replace a linear's `weight`, and their values.

Layouts: `fp8` (HF fine-grained, 128x128 blocks), `fp8-ct` (the same codes and scales as
compressed-tensors' float-quantized FP8_BLOCK, scale named weight_scale), `nvfp4` (compressed-tensors nvfp4-pack-quantized,
quantized by compressed-tensors' own compressor) and `nvfp4-modelopt` (the same codes and scales
under ModelOpt's names, weight_scale_2 = 1 / global scale). lm_head and the GDN layers' small
in_proj_a / in_proj_b stay in the model dtype, as releases keep such layers."""
from __future__ import annotations

import math
from typing import Any

import torch

from ninfer.quant import codec
from ninfer.quant.config import FP8_BLOCK, NVFP4_GROUP, QuantConfig, parse_quant_config

QUANT_KINDS = ("fp8", "fp8-ct", "nvfp4", "nvfp4-modelopt")
_TAGS = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16",
         torch.float16: "F16"}


def quantization_config(kind: str) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for `kind`."""
    if kind == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": ["lm_head", "in_proj_a", "in_proj_b"]}
    if kind == "fp8-ct":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                   "block_structure": [FP8_BLOCK, FP8_BLOCK], "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": FP8_BLOCK,
                "dynamic": True}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
                 "format": "float-quantized"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*in_proj_[ab]$"], "kv_cache_scheme": None}
    if kind == "nvfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": NVFP4_GROUP,
                   "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
                 "format": "nvfp4-pack-quantized"}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed", "config_groups": {"group_0": group},
                "ignore": ["lm_head", "re:.*in_proj_[ab]$"], "kv_cache_scheme": None}
    if kind == "nvfp4-modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_GROUP,
                "exclude_modules": ["lm_head", "*in_proj_a", "*in_proj_b"]}
    raise ValueError(f"unknown --quant {kind!r}; choose {', '.join(QUANT_KINDS)}")


def quant_config(kind: str) -> QuantConfig:
    qc = parse_quant_config({"quantization_config": quantization_config(kind)})
    assert qc is not None
    return qc


def is_quantized(qc: QuantConfig, name: str, shape: tuple[int, ...]) -> bool:
    """Whether checkpoint tensor `name` (a dense weight of `shape`) is written quantized."""
    return (name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name
            and qc.is_quantized(name[: -len(".weight")]))


def tensor_layout(qc: QuantConfig, name: str, shape: tuple[int, ...]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of the tensors that stand for the dense weight `name` of `shape`."""
    mod = name[: -len(".weight")]
    w, s, g = qc.tensor_names()
    n, k = shape
    if qc.method == "fp8":
        return [(f"{mod}.{w}", torch.float8_e4m3fn, (n, k)),
                (f"{mod}.{s}", torch.float32, (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)))]
    return [(f"{mod}.{w}", torch.uint8, (n, k // 2)), (f"{mod}.{s}", torch.float8_e4m3fn, (n, k // NVFP4_GROUP)),
            (f"{mod}.{g}", torch.float32, () if qc.layout == "modelopt" else (1,))]


def quantize(qc: QuantConfig, w: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of tensor_layout, in its order, for the dense weight w."""
    if qc.method == "fp8":
        return list(codec.fp8_block_quant(w))
    packed, scale, g = codec.nvfp4_quant(w)
    return [packed, scale, (1.0 / g).reshape(()) if qc.layout == "modelopt" else g]


def safetensors_tag(dtype: torch.dtype) -> str:
    return _TAGS[dtype]
