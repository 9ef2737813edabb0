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

Windowed formats (rk4v4-e8w; the pool has rings and the step carries state slots): the new tokens'
K/V also go to the ring (``kernels/window_attn.py``). Decode runs the split kernel over the pages of
[0, L - w) and ``decode_reduce`` merges the ring's [L - w, L) as one more partial, writing this
token to the ring as it goes (w = min(W, L - v) on the device, so graphs capture it). Prefill attends the
chunk's fresh K/V and the ring's copies of the cached part's last positions (``PrefillWindow``),
then writes the ring (the chunk may overwrite rows the cached part still needed).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch

from ninfer.attention.base import BaseAttentionBackend, StepMetadata
from ninfer.attention.prefill_sdpa import PrefillWindow
from ninfer.attention.selector import OPS, BoundOp, op_context, select_ops
from ninfer.kernels.window_attn import WindowTail, ring_write, window_width


class WindowPlan(NamedTuple):
    """A windowed step's per-step tensors (``plan``): decode: w [B] and the pages' lengths L - w;
    prefill: the ring rows to write (slot -1 = none; only a chunk's last W tokens) and each
    sequence's ring start on the host."""
    splits: int
    w: torch.Tensor | None
    page_lens: torch.Tensor | None
    slots: torch.Tensor | None
    pos: torch.Tensor | None
    starts: list[int] | None


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

    def plan(self, meta: StepMetadata) -> int | WindowPlan:
        """Decode: the KV splits of this batch shape (cached per (B, table width)); else 0. Windowed
        steps: a WindowPlan holding that number."""
        s = 0
        if meta.is_decode:
            key = (meta.num_seqs, int(meta.block_tables.shape[1]))
            s = self._splits.get(key)
            if s is None:
                s = self._splits[key] = int(self.num_splits or self._decode_splits(self.ctx, *key))
        meta.plan = s if not self.pool.windows or meta.state_slots is None else self._window_plan(meta, s)
        return meta.plan

    def _window_plan(self, meta: StepMetadata, splits: int) -> WindowPlan:
        slots, lens = meta.state_slots, meta.seq_lens
        if meta.is_decode:  # device ops only: a captured graph recomputes them on every replay
            w = window_width(self.pool.window_start, slots, lens, self.pool.window)
            return WindowPlan(splits, w, lens - w, None, None, None)
        qlens = meta.query_lens_cpu or (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        slens = meta.seq_lens_cpu or lens.tolist()
        starts = meta.window_start_cpu
        if starts is None:
            starts = self.pool.window_start[slots.clamp(min=0).long()].tolist()
        pos, keep = [], []
        for n, sl in zip(qlens, slens):
            pos.extend(range(sl - n, sl))
            keep.extend(i >= n - self.pool.window for i in range(n))
        dev = lens.device
        per_tok = torch.repeat_interleave(slots, torch.tensor(qlens, device=dev), output_size=len(pos))
        tok_slots = torch.where(torch.tensor(keep, device=dev), per_tok, -1).to(torch.int32)
        return WindowPlan(splits, None, None, tok_slots, torch.tensor(pos, dtype=torch.int64, device=dev),
                          list(starts))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        if k.shape[0] != t or v.shape != k.shape or k.shape[2] != d or hq % k.shape[1]:
            raise ValueError(f"attention: q {list(q.shape)} k {list(k.shape)} v {list(v.shape)} disagree")
        planes = self.pool.layers[layer]
        self._store(k, v, planes, meta.slot_mapping)
        plan = meta.plan if meta.plan is not None else self.plan(meta)
        ring = self.pool.windows[layer] if isinstance(plan, WindowPlan) else None
        if meta.is_decode:
            if meta.num_seqs != t:
                raise ValueError(f"decode step with {t} tokens for {meta.num_seqs} sequences")
            if q.stride(2) != 1:
                q = q.contiguous()
            if ring is None:
                return self._decode(q, planes, meta.block_tables, meta.seq_lens, scale, plan)
            # the ring's partial, and this token's ring write, happen inside the split reduction
            tail = WindowTail(q, k, v, ring, meta.state_slots, meta.seq_lens, plan.w, scale)
            return self._decode(q, planes, meta.block_tables, plan.page_lens, scale, plan.splits, tail)
        if ring is None:
            return self._prefill(q, planes, meta, scale)
        out = self._prefill(q, planes, meta, scale, window=PrefillWindow(k, v, ring, meta.state_slots, plan.starts))
        ring_write(ring, k, v, plan.slots, plan.pos)
        return out


TritonAttentionBackend = KernelAttentionBackend  # the earlier name
