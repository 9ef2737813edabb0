"""Qwen2: the Llama decoder with q/k/v biases always on and never an o_proj bias."""
from __future__ import annotations

from ninfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
