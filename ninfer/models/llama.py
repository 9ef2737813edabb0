"""The dense Llama-family decoder (Llama, Mistral; Qwen2 and Qwen3 subclass it) over a flattened
varlen batch. The family differs only in class-level switches: q/k RMSNorm, which biases exist,
whether the config's sliding window is meaningful.

On CUDA the decoder carries the residual stream between layers (`DecoderLayer.forward_residual`)
so every residual add is fused into the next RMSNorm: per layer 4 small kernels instead of ~50."""
from __future__ import annotations

import logging

import torch
from torch import nn

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.layers import fused
from ninfer.distributed import parallel_state as ps
from ninfer.layers.attention import Attention
from ninfer.layers.linear import ParallelLMHead, VocabParallelEmbedding
from ninfer.layers.mlp import GatedMLP
from ninfer.layers.norm import RMSNorm
from ninfer.layers.rotary import RotaryEmbedding, normalize_rope_params, scaled_max_position
from ninfer.layers.tp_geometry import check_tensor_parallel
from ninfer.model_config import ConfigError, ModelConfig
from ninfer.models.base import CausalLM

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                         sin: torch.Tensor, meta: AttentionMetadata,
                         backend: BaseAttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the residual stream carried separately: the previous layer's MLP output x
        and the stream before it (None at the first layer, where x is the stream) -> this layer's
        MLP output and stream. Each add happens inside the next norm, rounded like `h + ...`, so
        summing the last pair reproduces `forward`'s h bit for bit."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_add(x, residual)
        x, residual = self.post_attention_layernorm.forward_add(self.self_attn(x, cos, sin, meta, backend), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        act = str(cfg.raw.get("hidden_act", "silu"))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_layer=i,
                          qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, eps=eps),
                GatedMLP(cfg.hidden_size, cfg.intermediate_size, mlp_bias, act),
                cfg.hidden_size, eps)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps)


class LlamaForCausalLM(CausalLM):
    qk_norm = False                     # per-head RMSNorm on q and k before RoPE (Qwen3)
    qkv_bias: bool | None = None        # None: the config's attention_bias
    o_bias: bool | None = None          # None: the config's attention_bias
    honors_sliding_window = False       # HF masks beyond config.sliding_window (Mistral); we attend fully

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if len(cfg.full_attention_layers) != cfg.num_layers:
            raise ConfigError(f"{cfg.architecture}: only full-attention layers are supported, but layers "
                              f"{sorted(set(range(cfg.num_layers)) - set(cfg.full_attention_layers))} are not")
        check_tensor_parallel(cfg, ps.tp_size())
        window = cfg.raw.get("sliding_window")
        if self.honors_sliding_window and window and int(window) < cfg.max_position_embeddings:
            log.warning("%s: sliding_window=%s is ignored; attention is full, so outputs differ from "
                        "transformers beyond %s tokens", cfg.architecture, window, window)
        self.config = cfg
        qkv = cfg.attention_bias if self.qkv_bias is None else self.qkv_bias
        o = cfg.attention_bias if self.o_bias is None else self.o_bias
        self.model = LlamaModel(cfg, qkv_bias=qkv, o_bias=o, mlp_bias=bool(cfg.raw.get("mlp_bias", False)),
                                qk_norm=self.qk_norm)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        self.tie_weights()
        self.rope_params = normalize_rope_params(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, self.rope_params, cfg.max_position_embeddings)
        self.max_position = scaled_max_position(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions)  # once per step, shared by every layer
        h = self.model.embed_tokens(input_ids)
        if fused.use_fused_kernels(h) and len(self.model.layers):
            # residual stream carried between layers: every residual add fused into the next norm
            residual = None
            for layer in self.model.layers:
                h, residual = layer.forward_residual(h, residual, cos, sin, meta, backend)
            return self.model.norm.forward_add(h, residual)[0]
        for layer in self.model.layers:
            h = layer(h, cos, sin, meta, backend)
        return self.model.norm(h)


class MistralForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False
    honors_sliding_window = True
