"""The kernel attention backend (the CUDA path; Triton kernels also run under TRITON_INTERPRET=1 on CPU).

Per layer and step: the store op encodes and scatters the new K/V (every format), then either the
decode op (every sequence has one new token; split-K flash-decoding) or the prefill op (chunked
prefill, causal, varlen) attends over the pages. Which implementation serves each op (CUDA C++ or
Triton) was decided once, at construction, by ``ninfer.attention.selector``; the result matches
``ReferenceAttentionBackend`` up to dot-operand rounding.

CUDA-graph safety of the decode path: no host syncs (shapes and flags are host metadata; the
kernels read seq_lens / block_tables / slot_mapping on the device), grids depend only on
B, Hkv and the block-table width (static in a captured graph), and the number of KV splits is
fixed per (batch size, table width): ``plan`` computes it once per step (``num_splits`` here,
else the chosen decode implementation's rule, which reads only the SM count, the kernel's
occupancy and the table width) and caches it per shape.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ninfer.attention.base import BaseAttentionBackend, StepMetadata
from ninfer.attention.selector import OPS, BoundOp, op_context, select_ops


class KernelAttentionBackend(BaseAttentionBackend):
    name = "kernels"

    def __init__(self, pool: Any, *, dtype: torch.dtype | None = None, num_heads: int | None = None,
                 force: Mapping[str, str] | None = None, num_splits: int | None = None,
                 ops: Mapping[str, BoundOp] | None = None) -> None:
        self.pool = pool
        self.fmt = pool.fmt
        self.num_splits = num_splits
        self.ctx = op_context(pool, dtype, num_heads)
        self.ops = dict(ops) if ops is not None else select_ops(self.ctx, force)
        self._store, self._decode, self._prefill = (self.ops[o].fn for o in OPS)
        self._decode_splits = self.ops["decode"].impl.num_splits
        self._splits: dict[tuple[int, int], int] = {}

    def kernel_paths(self) -> str:
        """e.g. ``store=cuda decode=triton (head_dim 64: CUDA path needs 128 or 256) prefill=triton``."""
        return " ".join(self.ops[o].line for o in OPS)

    def plan(self, meta: StepMetadata) -> int:
        """Decode: the KV splits of this batch shape (cached per (B, table width)); else 0."""
        if not meta.is_decode:
            meta.plan = 0
            return 0
        key = (meta.num_seqs, int(meta.block_tables.shape[1]))
        s = self._splits.get(key)
        if s is None:
            s = self._splits[key] = int(self.num_splits or self._decode_splits(self.ctx, *key))
        meta.plan = s
        return s

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        if k.shape[0] != t or v.shape != k.shape or k.shape[2] != d or hq % k.shape[1]:
            raise ValueError(f"attention: q {list(q.shape)} k {list(k.shape)} v {list(v.shape)} disagree")
        planes = self.pool.layers[layer]
        self._store(k, v, planes, meta.slot_mapping)
        if meta.is_decode:
            if meta.num_seqs != t:
                raise ValueError(f"decode step with {t} tokens for {meta.num_seqs} sequences")
            if q.stride(2) != 1:
                q = q.contiguous()
            splits = meta.plan if meta.plan is not None else self.plan(meta)
            return self._decode(q, planes, meta.block_tables, meta.seq_lens, scale, splits)
        return self._prefill(q, planes, meta, scale)


TritonAttentionBackend = KernelAttentionBackend  # the earlier name
