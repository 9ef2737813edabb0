"""Tensor-parallel geometry from the config alone (no torch): which sizes a tensor-parallel size
must divide, and one rank's view of the model (its heads, its MLP columns), which the planner
sizes the KV pool, the states and the workspace from.

Every head-shaped dimension is split evenly: attention q and KV heads, the Gated DeltaNet key and
value heads, the MLP intermediate size. KV heads are never replicated, so N must divide them (a
GQA model with fewer KV heads than ranks is refused). The vocabulary is split in chunks of
ceil(V / N) rows; the last rank's padding rows are never looked up and their logits are dropped."""
from __future__ import annotations

import dataclasses

from ninfer.model_config import ConfigError, ModelConfig


def _gdn_heads(cfg: ModelConfig) -> tuple[int, int] | None:
    r = cfg.raw
    if not cfg.is_hybrid or "linear_num_value_heads" not in r:
        return None
    return int(r["linear_num_key_heads"]), int(r["linear_num_value_heads"])


def model_name(cfg: ModelConfig) -> str:
    path = str(cfg.raw.get("_name_or_path") or "").rstrip("/")
    return path.rsplit("/", 1)[-1] if path else cfg.architecture


def check_tensor_parallel(cfg: ModelConfig, tp: int, name: str | None = None) -> None:
    """ConfigError (one line, with the numbers) unless `tp` ranks can each hold an equal share of
    every head-split dimension of the model `name` (default: the config's name or architecture)."""
    name = name or model_name(cfg)
    if tp < 1:
        raise ConfigError(f"tensor-parallel-size must be >= 1, got {tp}")
    if tp == 1:
        return
    if tp > cfg.num_kv_heads:
        raise ConfigError(f"tensor-parallel-size {tp} exceeds the {cfg.num_kv_heads} KV heads of {name}: KV heads "
                          f"are split across ranks, never replicated; use at most {cfg.num_kv_heads}")
    dims = [(cfg.num_kv_heads, "KV heads"), (cfg.num_heads, "attention heads"),
            (cfg.intermediate_size, "MLP intermediate columns")]
    gdn = _gdn_heads(cfg)
    if gdn:
        dims += [(gdn[0], "linear-attention key heads"), (gdn[1], "linear-attention value heads")]
    for n, what in dims:
        if n % tp:
            raise ConfigError(f"tensor-parallel-size {tp} does not divide the {n} {what} of {name}")


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """One rank's geometry: heads, KV heads, GDN heads and intermediate size divided by `tp`; the
    hidden size and the vocabulary stay whole (every rank holds the gathered logits)."""
    check_tensor_parallel(cfg, tp)
    if tp == 1:
        return cfg
    raw = dict(cfg.raw)
    gdn = _gdn_heads(cfg)
    if gdn:
        raw.update(linear_num_key_heads=gdn[0] // tp, linear_num_value_heads=gdn[1] // tp)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp, raw=raw)


def vocab_shard(vocab: int, tp: int) -> int:
    """Rows of the embedding and lm_head each rank holds."""
    return -(-vocab // tp)


def shard_param_count(cfg: ModelConfig, tp: int) -> int:
    """Parameters one rank holds (rank 0; every rank holds as many): the split dimensions divided,
    norms and row-parallel biases whole, the vocabulary in ceil(V / N) rows. tp=1: num_params()."""
    local = local_config(cfg, tp)
    return dataclasses.replace(local, vocab_size=vocab_shard(cfg.vocab_size, tp)).num_params()
