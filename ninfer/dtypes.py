"""The one table of floating-point dtype names: every spelling `--dtype`, config.json's
`torch_dtype` or a caller may use, mapped to a canonical short name (bf16, fp16, fp32), its size,
its safetensors tag and its torch dtype. Importing this does not import torch (the planner and
`ninfer plan` work from config.json alone)."""
from __future__ import annotations

from typing import Any

# spelling -> canonical short name
ALIASES: dict[str, str] = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}
BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
SAFETENSORS_TAGS: dict[str, str] = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
_TORCH_ATTR = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def canonical(name: Any) -> str:
    """Any spelling (or a torch.dtype) -> 'bf16' / 'fp16' / 'fp32'; ValueError otherwise."""
    key = str(name).removeprefix("torch.")
    if key not in ALIASES:
        raise ValueError(f"unknown dtype {name!r}; choose bf16, fp16 or fp32")
    return ALIASES[key]


def num_bytes(name: Any) -> int:
    return BYTES[canonical(name)]


def to_torch(name: Any) -> Any:
    """A dtype name (any spelling) or a torch.dtype -> the torch.dtype."""
    import torch
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, _TORCH_ATTR[canonical(name)])


def short_name(dtype: Any) -> str:
    """torch.bfloat16 -> 'bf16' (unknown dtypes as torch spells them)."""
    try:
        return canonical(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")
