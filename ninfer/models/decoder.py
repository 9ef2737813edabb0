"""The shared dense decoder (Qwen3, Qwen2, Llama, Mistral) over a flattened varlen batch.

Module names follow the HF checkpoints (`model.layers.N.self_attn...`, `lm_head`), except that
q|k|v and gate|up are merged linears; `checkpoint_map()` tells the loader which checkpoint tensor
fills which rows of which parameter."""
from __future__ import annotations

import logging

import torch
from torch import nn

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.model_config import ConfigError, ModelConfig
from ninfer.models import layers as model_layers
from ninfer.models.layers import Attention, DecoderLayer, GatedMLP, MergedLinear, RMSNorm
from ninfer.models.registry import ArchSpec
from ninfer.models.rope import RotaryEmbedding, normalize_rope_params, scaled_max_position

log = logging.getLogger(__name__)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ArchSpec) -> None:
        super().__init__()
        qkv_bias, o_bias, mlp_bias = spec.biases(cfg)
        eps = cfg.rms_norm_eps
        kv_index = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}
        act = str(cfg.raw.get("hidden_act", "silu"))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_layer=kv_index[i],
                          qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=spec.qk_norm, eps=eps),
                GatedMLP(cfg.hidden_size, cfg.intermediate_size, mlp_bias, act),
                cfg.hidden_size, eps)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps)


class CausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], meta, backend) -> hidden [T, H]`;
    `compute_logits(hidden [N, H]) -> [N, V] float32`. `config` is the (rope-overridden) ModelConfig."""

    def __init__(self, cfg: ModelConfig, spec: ArchSpec) -> None:
        super().__init__()
        if len(cfg.full_attention_layers) != cfg.num_layers:
            raise ConfigError(f"{cfg.architecture}: only full-attention layers are supported, but layers "
                              f"{sorted(set(range(cfg.num_layers)) - set(cfg.full_attention_layers))} are not")
        window = cfg.raw.get("sliding_window")
        if spec.honors_sliding_window and window and int(window) < cfg.max_position_embeddings:
            log.warning("%s: sliding_window=%s is ignored; attention is full, so outputs differ from "
                        "transformers beyond %s tokens", cfg.architecture, window, window)
        self.config = cfg
        self.spec = spec
        self.model = DecoderModel(cfg, spec)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_params = normalize_rope_params(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, self.rope_params, cfg.max_position_embeddings)
        self.max_position = scaled_max_position(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions)  # once per step, shared by every layer
        h = self.model.embed_tokens(input_ids)
        if model_layers.use_fused_kernels(h) and len(self.model.layers):
            # residual stream carried between layers: every residual add fused into the next norm
            residual = None
            for layer in self.model.layers:
                h, residual = layer.forward_residual(h, residual, cos, sin, meta, backend)
            return self.model.norm.forward_add(h, residual)[0]
        for layer in self.model.layers:
            h = layer(h, cos, sin, meta, backend)
        return self.model.norm(h)

    def cache_specs(self, fmt) -> "CacheSpec":
        """What each layer keeps between steps (ninfer/kvcache/spec.py): paged KV in ``fmt`` for every layer."""
        from ninfer.kvcache.spec import CacheSpec
        cfg = self.config
        return CacheSpec.uniform_attention(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, fmt)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def checkpoint_map(self) -> dict[str, tuple[str, int | None, int | None]]:
        """checkpoint tensor name -> (parameter name, first row, rows); rows None = the whole
        parameter. A tied lm_head is not listed (it is the embedding)."""
        out: dict[str, tuple[str, int | None, int | None]] = {}
        merged: set[str] = set()
        for mod_name, mod in self.named_modules():
            if isinstance(mod, MergedLinear):
                parent = mod_name.rsplit(".", 1)[0]
                for part, (start, rows) in mod.part_rows().items():
                    for kind in ("weight", "bias") if mod.bias is not None else ("weight",):
                        out[f"{parent}.{part}.{kind}"] = (f"{mod_name}.{kind}", start, rows)
                merged.update({f"{mod_name}.weight", f"{mod_name}.bias"})
        for name, _ in self.named_parameters():  # shared (tied) parameters are listed once
            if name not in merged:
                out[name] = (name, None, None)
        return out

    def describe(self) -> str:
        cfg, p = self.config, self.rope_params
        rope = p["rope_type"] + "".join(f" {k}={p[k]}" for k in ("factor", "original_max_position_embeddings")
                                        if k in p)
        return (f"model: {cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads}"
                f" kv_heads={cfg.num_kv_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size} dtype={self.dtype}"
                f" rope={rope} theta={p['rope_theta']:g} attention_factor={self.rotary_emb.attention_factor:.6g}"
                f" max_position={self.max_position}")
