"""What every causal LM here shares: the forward contract the runner calls, logits, the
checkpoint name map the loader fills from, and the startup description.

    forward(input_ids [T], positions [T], meta, backend) -> hidden [T, H]
    compute_logits(hidden [N, H]) -> [N, V] float32

Module names follow the HF checkpoints (`model.layers.N.self_attn...`, `lm_head`), except that
merged linears (q|k|v, gate|up, ...) take several checkpoint tensors; `checkpoint_map()` says which
rows or columns of which checkpoint tensor fill which part of which parameter.

Under tensor parallelism (ninfer/layers/linear.py) each rank's model holds its shard: its heads,
its MLP columns, its vocabulary rows. `compute_logits` all_gathers the full vocabulary, so it
returns the same [N, V] float32 logits on every rank."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ninfer.distributed import parallel_state as ps
from ninfer.layers.linear import MergedLinear, shard_pieces
from ninfer.model_config import ModelConfig


class Target(NamedTuple):
    """Where a checkpoint tensor goes: `param`, from a checkpoint tensor of (global) `shape`; `pieces`
    ((checkpoint offset, parameter offset, length) along `dim`), or None for the whole tensor."""
    param: str
    shape: tuple[int, ...]
    dim: int = 0
    pieces: tuple[tuple[int, int, int], ...] | None = None


class CausalLM(nn.Module):
    """Subclasses set `config`, `model` (with `embed_tokens`) and `lm_head`, and define forward."""

    config: ModelConfig
    checkpoint_ignore: tuple[str, ...] = ()  # checkpoint tensor prefixes deliberately not loaded

    def place(self, device: torch.device) -> None:
        """Called once the weights live on `device`: pick device-specific kernels (default: none)."""

    def cache_specs(self, fmt):
        """What each layer keeps between steps (ninfer/kvcache/spec.py): paged KV in `fmt` for every
        layer, of this rank's KV heads."""
        from ninfer.kvcache.spec import CacheSpec
        cfg = self.config
        return CacheSpec.uniform_attention(cfg.num_layers, self.local_heads[1], cfg.head_dim, fmt)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32, the full vocabulary on every rank."""
        head = self.lm_head
        return head.gather_logits(hidden) if hasattr(head, "gather_logits") else head(hidden).float()  # quantized: whole

    @property
    def local_heads(self) -> tuple[int, int]:
        """(attention heads, KV heads) this rank computes: the config's divided by tp_size."""
        return self.config.num_heads // ps.tp_size(), self.config.num_kv_heads // ps.tp_size()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype  # lm_head may be stored quantized

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def checkpoint_map(self) -> dict[str, Target]:
        """checkpoint tensor name -> Target. Merged linears take their rows from several checkpoint
        tensors; split parameters (`tp_shards`) take this rank's rows or columns. A tied lm_head is
        not listed (it is the embedding)."""
        params = dict(self.named_parameters())  # shared (tied) parameters are listed once
        rank, size = ps.tp_rank(), ps.tp_size()
        out: dict[str, Target] = {}
        done: set[str] = set()
        for mod_name, mod in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            if hasattr(mod, "checkpoint_entries"):  # a quantized linear (ninfer/quant) names its own tensors
                for ck, (pname, start, rows) in mod.checkpoint_entries(mod_name).items():
                    shape = tuple(params[pname].shape)
                    out[ck] = Target(pname, shape, 0, None) if rows is None else \
                        Target(pname, (rows, *shape[1:]), 0, ((0, start, rows),))
                done.update(prefix + n for n, _ in mod.named_parameters())
                continue
            if isinstance(mod, MergedLinear):
                parent = mod_name.rsplit(".", 1)[0]
                kinds = ("weight", "bias") if mod.bias is not None else ("weight",)
                for part, (rows, pieces) in mod.part_pieces().items():
                    for kind in kinds:
                        p = getattr(mod, kind)
                        out[f"{parent}.{part}.{kind}"] = Target(prefix + kind, (rows, *p.shape[1:]), 0, tuple(pieces))
                done.update(prefix + k for k in kinds)
            for pname, (dim, blocks) in getattr(mod, "tp_shards", {}).items():
                full = prefix + pname
                if full in params:
                    shape = list(params[full].shape)
                    shape[dim] = sum(blocks)
                    out[full] = Target(full, tuple(shape), dim, tuple(shard_pieces(blocks, rank, size)))
                    done.add(full)
        for name, p in params.items():
            if name not in done:
                out[name] = Target(name, tuple(p.shape))
        return out

    def describe(self) -> str:
        cfg, p = self.config, self.rope_params
        rope = p["rope_type"] + "".join(f" {k}={p[k]}" for k in ("factor", "original_max_position_embeddings")
                                        if k in p)
        return (f"model: {cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads}"
                f" kv_heads={cfg.num_kv_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size} dtype={self.dtype}"
                f" rope={rope} theta={p['rope_theta']:g} attention_factor={self.rotary_emb.attention_factor:.6g}"
                f" max_position={self.max_position}"
                + (f" tensor_parallel={ps.tp_size()} rank={ps.tp_rank()} (heads/kv_heads per rank "
                   f"{'/'.join(map(str, self.local_heads))})" if ps.tp_size() > 1 else ""))
