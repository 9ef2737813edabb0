"""Which quantized-weight checkpoints load, read from `config.json`'s `quantization_config` (or
ModelOpt's `hf_quant_config.json`), and which linear of the checkpoint is quantized.

Supported (weight-only compute: activations stay in the model dtype):
* `fp8`: HF fine-grained FP8 (`fmt: e4m3`, `weight_block_size: [128, 128]`, dynamic activations):
  `weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)];
  w = weight * weight_scale_inv (the name notwithstanding, it multiplies).
  `modules_to_not_convert` entries match as substrings of the module name, as transformers does.
* `compressed-tensors`, format `float-quantized` with 128x128 block weights (llm-compressor's
  FP8_BLOCK): `weight` float8_e4m3fn and `weight_scale` [ceil(N/128), ceil(K/128)]; w = weight * weight_scale.
* `compressed-tensors`, format `nvfp4-pack-quantized`: `weight_packed` uint8 [N, K/2] (two e2m1 per
  byte, low nibble = even column), `weight_scale` float8_e4m3fn [N, K/16], `weight_global_scale`
  fp32 [1]; w = e2m1 * weight_scale / weight_global_scale. `ignore` entries are module names or
  `re:` regexes. An `input_global_scale` (W4A4) is not used.
* `modelopt`, `quant_algo: NVFP4`: the same packing, tensors `weight` (uint8), `weight_scale`, and
  `weight_scale_2` fp32 [] which MULTIPLIES: w = e2m1 * weight_scale * weight_scale_2 (so the
  compressed-tensors global scale is 1 / weight_scale_2). `exclude_modules` are fnmatch patterns.
Everything else (AWQ, GPTQ, bitsandbytes, int8 w8a8, per-tensor or static FP8, ...) is refused by name."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from ninfer.model_config import ConfigError

SUPPORTED = ("fp8 (HF fine-grained, e4m3, weight_block_size [128, 128])",
             "compressed-tensors float-quantized 128x128 blocks", "compressed-tensors nvfp4-pack-quantized",
             "modelopt NVFP4")
FP8_BLOCK = 128
NVFP4_GROUP = 16


class QuantConfigError(ConfigError):
    """A quantization_config this engine cannot load."""


def _refuse(what: str) -> QuantConfigError:
    return QuantConfigError(f"quantization {what} is not supported; supported: {'; '.join(SUPPORTED)}")


@dataclass(frozen=True)
class QuantConfig:
    method: str                      # "fp8" | "nvfp4"
    layout: str                      # "hf-fp8" | "ct-fp8" | "compressed-tensors" | "modelopt"
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)

    @property
    def name(self) -> str:
        return {"hf-fp8": "fp8 block 128x128", "ct-fp8": "fp8 block 128x128 (compressed-tensors)",
                "compressed-tensors": "nvfp4 (compressed-tensors)",
                "modelopt": "nvfp4 (modelopt)"}[self.layout]

    def is_quantized(self, module: str) -> bool:
        """Whether the checkpoint linear `module` (e.g. model.layers.0.mlp.up_proj) is stored quantized."""
        if self.layout == "hf-fp8":
            return not any(key in module for key in self.ignore)
        if self.layout == "modelopt":
            return not any(fnmatch.fnmatchcase(module, pat) for pat in self.ignore)

        def match(pat: str) -> bool:
            return re.match(pat[3:], module) is not None if pat.startswith("re:") else module == pat
        targeted = any(t == "Linear" or match(t) for t in self.targets)
        return targeted and not any(match(p) for p in self.ignore)

    def tensor_names(self) -> tuple[str, str, str | None]:
        """(packed weight, scale, per-part global) tensor names of a quantized linear."""
        return {"hf-fp8": ("weight", "weight_scale_inv", None), "ct-fp8": ("weight", "weight_scale", None),
                "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale"),
                "modelopt": ("weight", "weight_scale", "weight_scale_2")}[self.layout]


# tensors of quantized checkpoints the weight-only path does not use (activation and KV-cache scales)
UNUSED_SUFFIXES = (".input_scale", ".input_global_scale", ".k_scale", ".v_scale", ".output_scale")


def _fp8(q: dict[str, Any]) -> QuantConfig:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fp8 fmt={fmt!r}")
    block = q.get("weight_block_size")
    if block is None:
        raise _refuse("fp8 per-tensor (no weight_block_size)")
    if list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise _refuse(f"fp8 weight_block_size={list(block)}")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise _refuse(f"fp8 activation_scheme={act!r}")
    return QuantConfig("fp8", "hf-fp8", tuple(q.get("modules_to_not_convert") or ()))


def _compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    fmt = q.get("format")
    groups = q.get("config_groups") or {}
    formats = {g.get("format") or fmt for g in groups.values()} or {fmt}
    fp8 = formats == {"float-quantized"}
    if not groups:
        raise _refuse(f"compressed-tensors format {fmt} without config_groups")
    if formats != {"nvfp4-pack-quantized"} and not fp8:
        raise _refuse(f"compressed-tensors format {'/'.join(sorted(map(str, formats)))}")
    targets: list[str] = []
    for name, g in groups.items():
        w = g.get("weights") or {}
        if fp8:
            got = (w.get("num_bits"), w.get("type"), w.get("strategy"), list(w.get("block_structure") or []),
                   w.get("symmetric", True))
            if got != (8, "float", "block", [FP8_BLOCK, FP8_BLOCK], True):
                raise _refuse(f"compressed-tensors float-quantized group {name} with weights "
                              f"num_bits/type/strategy/block_structure/symmetric={got}")
            act = g.get("input_activations") or {}
            if act and not act.get("dynamic", False):
                raise _refuse(f"compressed-tensors float-quantized group {name} with static input_activations")
        else:
            got = (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("symmetric", True))
            if got != (4, "float", NVFP4_GROUP, True):
                raise _refuse(f"compressed-tensors group {name} with weights num_bits/type/group_size/symmetric={got}")
        targets += g.get("targets") or []
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"compressed-tensors quantization_status={status!r} (only compressed checkpoints load)")
    return QuantConfig("fp8" if fp8 else "nvfp4", "ct-fp8" if fp8 else "compressed-tensors",
                       tuple(q.get("ignore") or ()), tuple(targets) or ("Linear",))


def _modelopt(q: dict[str, Any]) -> QuantConfig:
    inner = q.get("quantization", q)  # hf_quant_config.json nests it
    algo = inner.get("quant_algo")
    if algo != "NVFP4":
        raise _refuse(f"modelopt quant_algo={algo!r}")
    group = int(inner.get("group_size", NVFP4_GROUP))
    if group != NVFP4_GROUP:
        raise _refuse(f"modelopt NVFP4 group_size={group}")
    return QuantConfig("nvfp4", "modelopt", tuple(inner.get("exclude_modules") or ()))


def parse_quant_config(raw: dict[str, Any]) -> QuantConfig | None:
    """The checkpoint's quantization (None for a plain one) from config.json's fields; refuses an
    unsupported scheme with a one-line QuantConfigError that names it."""
    q = raw.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise QuantConfigError(f"quantization_config must be an object, got {q!r}")
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "modelopt":
        return _modelopt(q)
    bits = f" ({q['bits']}-bit)" if "bits" in q else ""
    raise _refuse(f"method {method or '(none)'!r}{bits}")
