"""Qwen3.5 (`qwen3_5_text`, and the language model of the image-text `qwen3_5` releases): a hybrid
of Gated DeltaNet linear-attention layers (ninfer/layers/gdn.py) and gated full-attention layers
(`layer_types`, or every `full_attention_interval`-th layer), each followed by a SwiGLU MLP.

Full attention here: q_proj yields per head the query and an output gate ([H, 2D], query first),
q/k get an offset RMSNorm (1 + w) (on CUDA fused with RoPE and key centring:
ninfer/kernels/qk_norm_rope.py), RoPE turns only the first `partial_rotary_factor` of each head
(text positions: the three mRoPE sections coincide, so it is plain RoPE), and the attention output
is multiplied by sigmoid(gate) before o_proj. All norms are offset RMSNorms except the gated one
inside the GDN layer. Only attention layers hold paged KV; GDN layers hold a state slot per
sequence (`cache_specs`).

Tensor parallel: gated attention splits by heads as the dense decoder does (q_proj's per-head
query|gate rows stay together); GDN layers split by their key/value heads (ninfer/layers/gdn.py).

Qwen3-Next (`qwen3_next`) shares the layers but routes every MLP through a 512-expert MoE block
that has no grouped-expert kernel here: it is refused at load with that reason."""
from __future__ import annotations

import logging

import torch
from torch import nn

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.distributed import parallel_state as ps
from ninfer.layers import fused, gdn
from ninfer.layers.linear import MergedLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from ninfer.layers.mlp import GatedMLP
from ninfer.layers.norm import OffsetRMSNorm
from ninfer.layers.rotary import RotaryEmbedding, apply_rotary, normalize_rope_params, scaled_max_position
from ninfer.layers.tp_geometry import check_tensor_parallel
from ninfer.model_config import ConfigError, ModelConfig
from ninfer.models.base import CausalLM

log = logging.getLogger(__name__)
qk_norm_rope = fused.lazy_kernel("ninfer.kernels.qk_norm_rope", "qk_norm_rope")


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, kv_layer: int) -> None:
        super().__init__()
        h, d, size = cfg.hidden_size, cfg.head_dim, ps.tp_size()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // size, cfg.num_kv_heads // size, d
        self.kv_layer = kv_layer
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = d ** -0.5
        bias = cfg.attention_bias
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = MergedLinear(h, (("q_proj", 2 * q), ("k_proj", kv), ("v_proj", kv)), bias)
        self.o_proj = RowParallelLinear(q, h, bias=bias)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_norm_eps)
        self.key_transform = None  # exact key centring/smoothing before the cache (kvcache/centering.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split((2 * self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, gate = qg.reshape(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        tf = self.key_transform
        if fused.use_fused_kernels(q):  # offset q/k norm, RoPE and key centring in one launch
            q, k = qk_norm_rope(q, k, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                offset_norm=True, **(tf.fused_args() if tf is not None else {}))
        else:
            q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
            if tf is not None:
                q, k = tf(q, k)
        out = backend.forward(self.kv_layer, q, k, v, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size)))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module, is_linear: bool) -> None:
        super().__init__()
        if is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.is_linear = is_linear
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, str(cfg.raw.get("hidden_act", "silu")))
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        x = self.input_layernorm(h)
        x = self.linear_attn(x, meta, backend) if self.is_linear else self.self_attn(x, cos, sin, meta, backend)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        raw = cfg.raw
        full = set(cfg.full_attention_layers)
        kv_index = {layer: i for i, layer in enumerate(cfg.full_attention_layers)}
        linear = [i for i in range(cfg.num_layers) if i not in full]
        state_index = {layer: i for i, layer in enumerate(linear)}
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        layers = []
        for i in range(cfg.num_layers):
            if i in full:
                layers.append(Qwen3_5DecoderLayer(cfg, GatedAttention(cfg, kv_layer=kv_index[i]), False))
            else:
                mixer = gdn.GatedDeltaNet(
                    cfg.hidden_size, int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"]),
                    int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"]),
                    int(raw.get("linear_conv_kernel_dim", 4)), cfg.rms_norm_eps, state_layer=state_index[i])
                layers.append(Qwen3_5DecoderLayer(cfg, mixer, True))
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(CausalLM):
    checkpoint_ignore = ("mtp.",)  # the multi-token-prediction head (speculative decoding) is not used

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        missing = [k for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                               "linear_value_head_dim") if k not in cfg.raw]
        if missing:
            raise ConfigError(f"{cfg.architecture}: config.json lacks {', '.join(missing)}")
        if not cfg.full_attention_layers:
            raise ConfigError(f"{cfg.architecture}: no full-attention layer (layer_types); a KV cache needs one")
        check_tensor_parallel(cfg, ps.tp_size())
        self.config = cfg
        self.model = Qwen3_5TextModel(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        self.tie_weights()
        self.rope_params = normalize_rope_params(cfg)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, self.rope_params, cfg.max_position_embeddings)
        self.max_position = scaled_max_position(cfg)
        self.gdn_impl = "torch"

    def place(self, device: torch.device) -> None:
        """Pick the GDN kernels once for the device: fla-core's on CUDA, the torch reference elsewhere."""
        self.gdn_impl = "fla" if device.type == "cuda" and gdn.fla_available() else "torch"
        if device.type == "cuda" and self.gdn_impl == "torch":
            log.warning("fla-core is not importable: GDN layers run the float32 torch reference on CUDA (slow)")
        for m in self.modules():
            if isinstance(m, gdn.GatedDeltaNet):
                m.impl = self.gdn_impl

    def linear_layers(self) -> list[gdn.GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def cache_specs(self, fmt):
        """Paged KV in `fmt` for the full-attention layers, a float32 state slot for each GDN layer
        (this rank's KV heads and GDN heads)."""
        from ninfer.kvcache.spec import AttentionSpec, CacheSpec, RecurrentStateSpec
        cfg = self.config
        att = AttentionSpec(self.local_heads[1], cfg.head_dim, fmt)
        return CacheSpec(tuple(RecurrentStateSpec(layer.linear_attn.state_shapes(), torch.float32)
                               if layer.is_linear else att for layer in self.model.layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        cos, sin = self.rotary_emb.cos_sin(positions)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, meta, backend)
        return self.model.norm(h)

    def describe(self) -> str:
        m = self.linear_layers()[0] if self.linear_layers() else None
        lin = (f" linear_layers={len(self.linear_layers())} gdn_heads={m.hk}k/{m.hv}v gdn_dims={m.dk}/{m.dv}"
               f" conv={m.kernel} gdn_kernels={self.gdn_impl}") if m else ""
        return (super().describe() + f" full_attention_layers={len(self.config.full_attention_layers)}"
                f" rotary_dim={self.rotary_emb.rotary_dim}" + lin)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The image-text release: its language model is served, the vision tower is not loaded. The
    checkpoint keeps the text weights under `model.language_model.`."""

    checkpoint_ignore = ("mtp.", "model.visual.")

    def place(self, device: torch.device) -> None:
        super().place(device)
        log.warning("%s: serving the language model only; the vision tower (model.visual.*) is not loaded",
                    self.config.architecture)

    def checkpoint_map(self) -> dict[str, tuple[str, int | None, int | None]]:
        return {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                for k, v in super().checkpoint_map().items()}


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        raise ConfigError(
            f"{cfg.architecture} (qwen3_next) is not supported: its MoE block ({cfg.raw.get('num_experts', '?')} "
            "experts) has no grouped-expert kernel here and would run one expert matmul at a time; "
            "Qwen3.5 dense hybrids (qwen3_5_text) are supported")
