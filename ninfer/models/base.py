"""What every causal LM here shares: the forward contract the runner calls, logits, the
checkpoint name map the loader fills from, and the startup description.

    forward(input_ids [T], positions [T], meta, backend) -> hidden [T, H]
    compute_logits(hidden [N, H]) -> [N, V] float32

Module names follow the HF checkpoints (`model.layers.N.self_attn...`, `lm_head`), except that
merged linears (q|k|v, gate|up, ...) take several checkpoint tensors; `checkpoint_map()` says which
checkpoint tensor fills which rows of which parameter."""
from __future__ import annotations

import torch
from torch import nn

from ninfer.layers.linear import MergedLinear
from ninfer.model_config import ModelConfig


class CausalLM(nn.Module):
    """Subclasses set `config`, `model` (with `embed_tokens`) and `lm_head`, and define forward."""

    config: ModelConfig
    checkpoint_ignore: tuple[str, ...] = ()  # checkpoint tensor prefixes deliberately not loaded

    def place(self, device: torch.device) -> None:
        """Called once the weights live on `device`: pick device-specific kernels (default: none)."""

    def cache_specs(self, fmt):
        """What each layer keeps between steps (ninfer/kvcache/spec.py): paged KV in `fmt` for every layer."""
        from ninfer.kvcache.spec import CacheSpec
        cfg = self.config
        return CacheSpec.uniform_attention(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, fmt)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype  # lm_head may be stored quantized

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def checkpoint_map(self) -> dict[str, tuple[str, int | None, int | None]]:
        """checkpoint tensor name -> (parameter name, first row, rows); rows None = the whole
        parameter. A tied lm_head is not listed (it is the embedding)."""
        out: dict[str, tuple[str, int | None, int | None]] = {}
        merged: set[str] = set()
        for mod_name, mod in self.named_modules():
            if hasattr(mod, "checkpoint_entries"):  # a quantized linear (ninfer/quant) names its own tensors
                out.update(mod.checkpoint_entries(mod_name))
                merged.update(f"{mod_name}.{p}" for p, _ in mod.named_parameters())
            elif isinstance(mod, MergedLinear):
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
