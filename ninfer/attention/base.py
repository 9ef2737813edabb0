"""The attention contract between the model and the KV cache.

The model calls `backend.forward(layer, q, k, v, meta)` once per attention layer with the *new*
tokens of every sequence in the step, flattened (varlen, as vLLM does). The backend first stores
the new K/V into the paged cache through the KV format (so what is attended is what is stored,
quantized or not), then attends each query over its sequence's cached tokens, causally.
CPU uses `ReferenceAttentionBackend` (torch); CUDA uses the Triton backend. Both see the same
metadata, so the engine never knows which one runs."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
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

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class BaseAttentionBackend(ABC):
    """Owns nothing but the algorithm; the KV pool (planes per layer) is passed at construction."""

    name: str = "base"

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after RoPE and q/k norm) -> out [T, Hq, D] in q's dtype."""

    def kernel_paths(self, num_heads: int, dtype: torch.dtype) -> str:
        """What computes attention, for the startup log ("decode=cuda store=cuda", ...)."""
        return self.name
