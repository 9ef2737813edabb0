"""Supported architectures, keyed by `architectures[0]` of config.json. The dense Llama-family
decoders differ only in a few switches, so each entry is an `ArchSpec` for the shared decoder."""
from __future__ import annotations

from dataclasses import dataclass

from ninfer.model_config import ModelConfig


@dataclass(frozen=True)
class ArchSpec:
    name: str
    qk_norm: bool                 # per-head RMSNorm on q and k before RoPE (Qwen3)
    qkv_bias: bool | None         # None: the config's attention_bias
    o_bias: bool | None           # None: the config's attention_bias
    honors_sliding_window: bool   # HF masks beyond config.sliding_window (Mistral); we attend fully

    def biases(self, cfg: ModelConfig) -> tuple[bool, bool, bool]:
        """(qkv bias, o_proj bias, mlp bias) for this config."""
        qkv = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        o = cfg.attention_bias if self.o_bias is None else self.o_bias
        return qkv, o, bool(cfg.raw.get("mlp_bias", False))


ARCHITECTURES: dict[str, ArchSpec] = {
    "Qwen3ForCausalLM": ArchSpec("qwen3", qk_norm=True, qkv_bias=None, o_bias=None, honors_sliding_window=False),
    # Qwen2 always has q/k/v biases and never an o_proj bias
    "Qwen2ForCausalLM": ArchSpec("qwen2", qk_norm=False, qkv_bias=True, o_bias=False, honors_sliding_window=False),
    "LlamaForCausalLM": ArchSpec("llama", qk_norm=False, qkv_bias=None, o_bias=None, honors_sliding_window=False),
    "MistralForCausalLM": ArchSpec("mistral", qk_norm=False, qkv_bias=False, o_bias=False,
                                   honors_sliding_window=True),
}


def get_arch_spec(architecture: str) -> ArchSpec:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}") from None
