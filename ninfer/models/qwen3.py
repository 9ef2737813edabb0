"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on q and k before RoPE."""
from __future__ import annotations

from ninfer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
