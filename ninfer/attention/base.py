"""The attention contract between the model and the KV cache.

The model calls `backend.forward(layer, q, k, v, meta)` once per attention layer with the *new*
tokens of every sequence in the step, flattened (varlen, as vLLM does). The backend first stores
the new K/V into the paged cache through the KV format (so what is attended is what is stored,
quantized or not), then attends each query over its sequence's cached tokens, causally.
CPU uses `ReferenceAttentionBackend` (torch); CUDA uses the kernel backend whose store / decode /
prefill implementations `ninfer.attention.selector.select_backend` chose once at startup. Both
see the same metadata, so the engine never knows which one runs.

Per step, `backend.plan(meta)` runs once (the runner calls it; otherwise the first layer does):
what depends only on the step's shape (decode splits, host copies of lengths) is computed there
and kept in `meta.plan`, so each layer's call is only the launch.

Recurrent layers (ninfer/kvcache/spec.py) read their per-sequence state through
`backend.state(j)` at the rows `meta.state_slots`, continuing from it where
`meta.has_initial_state` is set.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor      # [T] int64: page * page_size + offset for each new token; -1 = do not store
    query_start_loc: torch.Tensor   # [B+1] int32: cumulative new-token counts (cu_seqlens_q)
    seq_lens: torch.Tensor          # [B] int32: tokens in the cache for each sequence *after* this step
    block_tables: torch.Tensor      # [B, max_pages] int32: page ids of each sequence, padded with -1
    max_query_len: int
    max_seq_len: int
    is_decode: bool                 # every sequence has exactly one new token (CUDA-graph eligible)
    # Host copies, so the reference path and the scheduler never sync on device tensors.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Recurrent state (models with a RecurrentStateSpec layer; None otherwise): the state slot of
    # each sequence [B] int32 (-1 = padding row), and whether it continues a state (it had
    # computed tokens before this step) [B] bool; False = start from zeros.
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # Window rings (rk4v4-e8w): per sequence, the first position its ring holds (host copy of
    # pool.window_start at state_slots); None: read pool.window_start.
    window_start_cpu: list[int] | None = None
    plan: Any = None                # backend-private, set by backend.plan(meta) once per step

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


AttentionMetadata = StepMetadata  # the name the models and tests use


class BaseAttentionBackend(ABC):
    """Owns nothing but the algorithm; the KV pool (planes per layer, states) is passed at construction."""

    name: str = "base"
    pool: Any

    def plan(self, meta: StepMetadata) -> Any:
        """Per-step work shared by every layer; stored in meta.plan. Default: nothing to plan."""
        meta.plan = True
        return meta.plan

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after RoPE and q/k norm) -> out [T, Hq, D] in q's dtype."""

    def state(self, index: int) -> dict[str, torch.Tensor]:
        """The state tensors {name: [num_slots, *shape]} of the index-th recurrent layer."""
        return self.pool.states[index]

    def kernel_paths(self) -> str:
        """What computes attention, for the startup log ("store=cuda decode=cuda prefill=triton", ...)."""
        return self.name
