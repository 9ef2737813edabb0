"""Triton attention over the paged KV pool (the CUDA path; runs under TRITON_INTERPRET=1 on CPU).

Per layer and step: ``store_kv`` encodes and scatters the new K/V (every format), then either
``paged_decode`` (every sequence has one new token; split-K flash-decoding) or ``paged_prefill``
(chunked prefill, causal, varlen) attends over the pages. The result matches
``ReferenceAttentionBackend`` up to dot-operand rounding.

CUDA-graph safety of the decode path: no host syncs (shapes and flags are host metadata; the
kernels read seq_lens / block_tables / slot_mapping on the device), grids depend only on
B, Hkv and the block-table width (static in a captured graph), and the number of KV splits is
fixed per (batch size, table width) -- ``num_splits`` here, else the decode kernel's default,
which reads only the SM count and the table width.
"""
from __future__ import annotations

from typing import Any

import torch

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.kernels.prefill import paged_prefill
from ninfer.kernels.store_kv import store_kv


class TritonAttentionBackend(BaseAttentionBackend):
    name = "triton"

    def __init__(self, pool: Any, *, num_splits: int | None = None) -> None:
        self.pool = pool
        self.fmt = pool.fmt
        self.num_splits = num_splits
        self._decode = None  # imported lazily: written by another module owner

    def _paged_decode(self):
        if self._decode is None:
            from ninfer.kernels.paged_decode import paged_decode
            self._decode = paged_decode
        return self._decode

    def kernel_paths(self, num_heads: int, dtype: torch.dtype) -> str:
        """Which kernels serve decode and store, and why one falls back to Triton (e.g. neither nvcc nor NVRTC:
        the Triton decode kernel is several times slower on the 4-bit formats)."""
        from ninfer.kernels.paged_decode_cuda import cuda_decode_unsupported
        from ninfer.kernels.store_kv_cuda import cuda_store_unsupported

        p = self.pool
        why_d = cuda_decode_unsupported(self.fmt.name, p.device, dtype, p.head_dim, num_heads, p.num_kv_heads,
                                        p.page_size)
        why_s = cuda_store_unsupported(self.fmt.name, p.device, dtype, p.head_dim)
        return " ".join(f"{what}=" + ("cuda" if why is None else f"triton ({why})")
                        for what, why in (("decode", why_d), ("store", why_s))) + " prefill=triton"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        if k.shape[0] != t or v.shape != k.shape or k.shape[2] != d or hq % k.shape[1]:
            raise ValueError(f"TritonAttentionBackend: q {list(q.shape)} k {list(k.shape)} v {list(v.shape)} disagree")
        planes = self.pool.layers[layer]
        name = self.fmt.name
        store_kv(k, v, planes, meta.slot_mapping, name)
        kp = (planes["k"], planes.get("k_scale"))
        vp = (planes["v"], planes.get("v_scale"))
        if meta.is_decode:
            if meta.num_seqs != t:
                raise ValueError(f"decode step with {t} tokens for {meta.num_seqs} sequences")
            if q.stride(2) != 1:
                q = q.contiguous()
            return self._paged_decode()(q, kp, vp, meta.block_tables, meta.seq_lens, name, scale,
                                        num_splits=self.num_splits)
        return paged_prefill(q, kp, vp, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             meta.max_query_len, name, scale)
