"""Model geometry read from an HF `config.json` alone (no weights, no transformers import), so the
planner can size a deployment before anything is downloaded or loaded. Handles dense and hybrid
configs: only full-attention layers hold a KV cache."""
from __future__ import annotations

import builtins
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ninfer import dtypes

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                           "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")


class ConfigError(ValueError):
    """A config.json that is missing, unreadable or lacks a field the engine needs."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    torch_dtype: str
    attention_bias: bool
    full_attention_layers: tuple[int, ...]
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def num_kv_layers(self) -> int:
        return len(self.full_attention_layers)

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_hybrid(self) -> bool:
        """Linear-attention (Gated DeltaNet) layers between the full-attention ones (Qwen3.5)."""
        return self.num_kv_layers < self.num_layers

    def recurrent_state_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Per-sequence state of one Gated DeltaNet layer (hybrids; None otherwise): the conv window
        [K-1, 2 key_dim + value_dim] and the delta-rule state [value_heads, key_head_dim, value_head_dim]."""
        if not self.is_hybrid or "linear_num_value_heads" not in self.raw:
            return None
        r = self.raw
        hv, dk, dv = int(r["linear_num_value_heads"]), int(r["linear_key_head_dim"]), int(r["linear_value_head_dim"])
        conv = 2 * int(r["linear_num_key_heads"]) * dk + hv * dv
        return {"conv": (int(r.get("linear_conv_kernel_dim", 4)) - 1, conv), "ssm": (hv, dk, dv)}

    def num_params(self) -> int:
        """Parameter count from the geometry (embeddings, attention / GDN, MLP, norms, lm_head)."""
        h, v, i = self.hidden_size, self.vocab_size, self.intermediate_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        gated = self.model_type.startswith("qwen3_5")  # q_proj also yields the output gate
        attn = h * q * (2 if gated else 1) + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q * (2 if gated else 1) + 2 * kv
        if self.model_type == "qwen3" or gated:
            attn += 2 * self.head_dim  # q_norm, k_norm
        mlp_norms = 3 * h * i + 2 * h
        total = self.num_kv_layers * (attn + mlp_norms)
        if self.is_hybrid:
            r = self.raw
            hv, kd = int(r.get("linear_num_value_heads", 0)), int(r.get("linear_num_key_heads", 0))
            dk, dv = int(r.get("linear_key_head_dim", 0)), int(r.get("linear_value_head_dim", 0))
            conv = 2 * kd * dk + hv * dv
            gdn = h * (conv + hv * dv + 2 * hv) + conv * int(r.get("linear_conv_kernel_dim", 4)) + 2 * hv + dv
            gdn += hv * dv * h  # out_proj
            total += (self.num_layers - self.num_kv_layers) * (gdn + mlp_norms)
        emb = v * h
        return emb + total + h + (0 if self.tie_word_embeddings else emb)

    def weight_bytes(self, dtype: str | None = None) -> int:
        """Bytes of the weights at `dtype` (the activation dtype); a quantized checkpoint's linears
        count at their packed size plus scales (ninfer/quant/size.py)."""
        name = dtype or self.torch_dtype
        if name not in dtypes.ALIASES:
            raise ConfigError(f"unknown weights dtype {name!r}; choose one of bf16, fp16, fp32")
        from ninfer.quant import parse_quant_config
        from ninfer.quant.size import weight_bytes
        qc = parse_quant_config(self.raw)
        act = dtypes.num_bytes(name)
        return self.num_params() * act if qc is None else weight_bytes(self, qc, act)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        def need(key: str) -> Any:
            if key not in cfg:
                raise ConfigError(f"config.json lacks required field {key!r}")
            return cfg[key]

        def int(value: Any, key: str = "") -> Any:  # builtins.int, naming the field when the value is bad
            try:
                if isinstance(value, (bool, builtins.float)) or (isinstance(value, str) and not value.strip().isdigit()):
                    raise ValueError
                return builtins.int(value)
            except (TypeError, ValueError):
                what = next((k for k, v in cfg.items() if v is value), key) if not key else key
                raise ConfigError(f"config.json field {what!r} must be an integer, got {value!r}") from None

        def float(value: Any) -> Any:
            try:
                return builtins.float(value)
            except (TypeError, ValueError):
                what = next((k for k, v in cfg.items() if v is value), "?")
                raise ConfigError(f"config.json field {what!r} must be a number, got {value!r}") from None

        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(cfg.get("model_type", ""), "")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(need("num_hidden_layers"))
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        layer_types = cfg.get("layer_types")
        interval = cfg.get("full_attention_interval")
        if layer_types:
            full = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
        elif interval:
            full = tuple(i for i in range(layers) if (i + 1) % int(interval) == 0)
        else:
            full = tuple(range(layers))
        rope_scaling = cfg.get("rope_scaling") or None
        rope_params = cfg.get("rope_parameters") or None
        theta = cfg.get("rope_theta")
        if rope_params:
            theta = theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default" and not rope_scaling:
                rope_scaling = dict(rope_params)
        model_type = cfg.get("model_type", "")
        return cls(
            architecture=arch, model_type=model_type, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")), num_layers=layers, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta or 10000.0),
            rope_scaling=rope_scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            full_attention_layers=full, raw=cfg,
        )

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """`path` is a model directory or a config.json file."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config.json at {p}")
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ConfigError(f"{p} is not a JSON object")
        if "text_config" in cfg and "hidden_size" not in cfg:
            # Multimodal wrappers keep the dtype (and sometimes tying) at the top level only.
            outer = {k: cfg[k] for k in ("torch_dtype", "dtype", "tie_word_embeddings", "quantization_config")
                     if k in cfg}
            cfg = {**outer, **cfg["text_config"], "architectures": cfg.get("architectures")}
        ho = p.parent / "hf_quant_config.json"  # ModelOpt's own file, when config.json does not say
        if "quantization_config" not in cfg and ho.is_file():
            try:
                cfg["quantization_config"] = {"quant_method": "modelopt", **json.loads(ho.read_text())}
            except json.JSONDecodeError as e:
                raise ConfigError(f"{ho} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(cfg)
        except ConfigError as e:
            raise ConfigError(f"{p}: {str(e).removeprefix('config.json ')}") from None
