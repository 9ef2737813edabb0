"""Supported architectures, keyed by `architectures[0]` of config.json: the name maps to
"module:Class", imported on first use (so adding a family costs nothing until it is loaded)."""
from __future__ import annotations

import importlib

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "ninfer.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "ninfer.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "ninfer.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "ninfer.models.qwen3:Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM": "ninfer.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "ninfer.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3NextForCausalLM": "ninfer.models.qwen3_5:Qwen3NextForCausalLM",
}


def get_model_class(architecture: str) -> type:
    try:
        target = ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
