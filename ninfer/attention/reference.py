"""Torch attention over the paged KV pool: the CPU path and the oracle the GPU kernels are tested
against. Deliberately plain: store through `fmt.encode`, read back through `fmt.decode`, attend in
float32. What is attended is exactly what was stored, so quantized formats are measured honestly."""
from __future__ import annotations

from typing import Any

import torch

from ninfer.attention.base import BaseAttentionBackend, StepMetadata

# Bound on one score block (query rows x cached tokens x heads, float32 elements), so a long
# prefill chunk over a long context does not materialize a huge [H, q, L] matrix at once.
_MAX_SCORE_ELEMS = 1 << 25


class ReferenceAttentionBackend(BaseAttentionBackend):
    name = "reference"

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.fmt = pool.fmt
        self.page_size = int(pool.page_size)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Encode k/v [T, Hkv, D] and scatter them to their slots (slot -1 = do not store)."""
        planes = self.pool.layers[layer]
        keep = slot_mapping >= 0
        if not bool(keep.any()):
            return
        slots = slot_mapping[keep].to(torch.long)
        page, off = slots // self.page_size, slots % self.page_size
        for name, x in (("k", k[keep]), ("v", v[keep])):
            data, scale = self.fmt.encode(x)
            # plane[page, :, off] indexes as [n, Hkv, extent]
            planes[name][page, :, off] = data.to(planes[name].dtype)
            if scale is not None:
                planes[f"{name}_scale"][page, :, off] = scale.to(planes[f"{name}_scale"].dtype)

    def gather(self, layer: int, name: str, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Decoded values [Hkv, seq_len, D] float32 of one sequence, un-rotated."""
        planes = self.pool.layers[layer]

        def tokens(plane: torch.Tensor) -> torch.Tensor:
            x = plane[pages]  # [P, Hkv, page_size, E]
            return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[:, :seq_len]

        scale = planes.get(f"{name}_scale")
        return self.fmt.decode(tokens(planes[name]), None if scale is None else tokens(scale),
                               rotated=False, dtype=torch.float32)

    def plan(self, meta: StepMetadata) -> tuple[list[int], list[int]]:
        """Host copies of the query starts and sequence lengths, once per step."""
        if meta.query_lens_cpu is not None:
            starts = [0]
            for n in meta.query_lens_cpu:
                starts.append(starts[-1] + int(n))
        else:
            starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
        meta.plan = (starts, [int(n) for n in seq_lens])
        return meta.plan

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        hkv = k.shape[1]
        if hq % hkv:
            raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
        group = hq // hkv
        self.store(layer, k, v, meta.slot_mapping)
        starts, seq_lens = meta.plan if isinstance(meta.plan, tuple) else self.plan(meta)
        out = torch.empty_like(q)
        for b, seq_len in enumerate(seq_lens):
            q0, q1 = int(starts[b]), int(starts[b + 1])
            q_len = q1 - q0
            if q_len == 0:
                continue
            if q_len > seq_len:
                raise ValueError(f"sequence {b}: {q_len} new tokens but seq_len {seq_len}")
            n_pages = -(-seq_len // self.page_size)
            pages = meta.block_tables[b, :n_pages].to(torch.long)
            if bool((pages < 0).any()):
                raise ValueError(f"sequence {b}: block table has no page for some of its {seq_len} tokens")
            kb = self.gather(layer, "k", pages, seq_len)  # [Hkv, L, D]
            vb = self.gather(layer, "v", pages, seq_len)
            # GQA: query head h reads KV head h // group; view q as [Hkv, group, q_len, D]
            qb = q[q0:q1].to(torch.float32).permute(1, 0, 2).reshape(hkv, group, q_len, d)
            # query i sits at absolute position seq_len - q_len + i and sees keys 0..that position
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            kpos = torch.arange(seq_len, device=q.device)
            rows = max(1, _MAX_SCORE_ELEMS // max(1, hq * seq_len))
            ob = torch.empty(hkv, group, q_len, d, dtype=torch.float32, device=q.device)
            for r0 in range(0, q_len, rows):
                r1 = min(q_len, r0 + rows)
                s = torch.matmul(qb[:, :, r0:r1], kb[:, None].transpose(-1, -2)) * scale  # [Hkv, g, r, L]
                s.masked_fill_(kpos[None, :] > qpos[r0:r1, None], float("-inf"))
                ob[:, :, r0:r1] = torch.matmul(torch.softmax(s, dim=-1), vb[:, None])
            out[q0:q1] = ob.reshape(hq, q_len, d).permute(1, 0, 2).to(q.dtype)
        return out
