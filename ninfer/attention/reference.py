"""Torch attention over the paged KV pool: the CPU path and the oracle the GPU kernels are tested
against. Deliberately plain: store through `fmt.encode`, read back through `fmt.decode`, attend in
float32. What is attended is exactly what was stored, so quantized formats are measured honestly.

Decoding every cached page at every step and layer dominated CPU decode, so decoded pages are kept
(`_DecodedPages`): a slot is only ever rewritten through `store`, which marks its page stale, so a
kept page equals a fresh decode of what is stored (pages freed, reused by another sequence, or
re-filled after preemption are all rewritten through `store` first).

Windowed formats (rk4v4-e8w; the pool has rings, the step carries state slots): the executable spec.
A sequence with C tokens cached before this step, q_len new ones and ring start v attends
* its new tokens as the layer computed them (model dtype, not read back from the pages);
* the ring's copies of cached positions [C - wc, C), wc = min(W - 1, C - v) in a decode step (so
  with the new token the last min(W, L - v) positions are model dtype, what the decode kernels read)
  and min(W, C - v) in a prefill step;
* the pages for [0, C - wc).
The ring is read before this step's tokens are written to it."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ninfer.attention.base import BaseAttentionBackend, StepMetadata

# Bound on one score block (query rows x cached tokens x heads, float32 elements), so a long
# prefill chunk over a long context does not materialize a huge [H, q, L] matrix at once.
_MAX_SCORE_ELEMS = 1 << 25


# Bound on the decoded-page cache over all layers (float32 K and V); past it the cache restarts.
_MAX_CACHE_BYTES = 1 << 30


class _DecodedPages:
    """One layer's decoded float32 K/V pages [Hkv, rows, page_size, D], indexed by page id through
    `row_of`; `fresh[page]` is False once `store` writes into the page and until it is decoded again."""

    def __init__(self, num_pages: int, max_rows: int) -> None:
        self.row_of = torch.full((num_pages,), -1, dtype=torch.long)
        self.fresh = torch.zeros(num_pages, dtype=torch.bool)
        self.max_rows = max_rows
        self.rows = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def clear(self) -> None:
        self.row_of.fill_(-1)
        self.fresh.fill_(False)
        self.rows = 0

    def assign(self, pages: torch.Tensor) -> bool:
        """Give rows to the (unique) pages that have none; False if the cache cannot hold them."""
        new = pages[self.row_of[pages] < 0]
        if self.rows + new.numel() > self.max_rows:
            self.clear()
            new = pages
            if new.numel() > self.max_rows:
                return False
        self.row_of[new] = torch.arange(self.rows, self.rows + new.numel())
        self.rows += new.numel()
        return True


class ReferenceAttentionBackend(BaseAttentionBackend):
    name = "reference"
    cache_pages = True  # False: decode every page at every step (the plain oracle)

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.fmt = pool.fmt
        self.page_size = int(pool.page_size)
        self._decoded: dict[int, _DecodedPages] = {}

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
        cache = self._decoded.get(layer)
        if cache is not None:
            cache.fresh[page.cpu()] = False

    def gather(self, layer: int, name: str, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Decoded values [Hkv, seq_len, D] float32 of one sequence, un-rotated."""
        planes = self.pool.layers[layer]

        def tokens(plane: torch.Tensor) -> torch.Tensor:
            x = plane[pages]  # [P, Hkv, page_size, E]
            return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[:, :seq_len]

        scale = planes.get(f"{name}_scale")
        return self.fmt.decode(tokens(planes[name]), None if scale is None else tokens(scale),
                               rotated=False, dtype=torch.float32)

    def _layer_cache(self, layer: int) -> _DecodedPages:
        cache = self._decoded.get(layer)
        if cache is None:
            k = self.pool.layers[layer]["k"]
            _, hkv, ps, _ = k.shape
            row_bytes = 2 * hkv * ps * self.pool.head_dim * 4 * len(self.pool.layers)
            cache = _DecodedPages(k.shape[0], max(1, min(k.shape[0], _MAX_CACHE_BYTES // row_bytes)))
            self._decoded[layer] = cache
        return cache

    def gather_kv(self, layer: int, pages: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K and V [Hkv, seq_len, D] float32 of one sequence, equal to `gather`'s: only the
        pages written since they were last decoded are decoded again."""
        if not self.cache_pages:
            return self.gather(layer, "k", pages, seq_len), self.gather(layer, "v", pages, seq_len)
        cache = self._layer_cache(layer)
        pages_cpu = pages.cpu()
        # pages in block-table order, so a sequence's pages get consecutive rows and read as a view
        uniq = torch.tensor(list(dict.fromkeys(pages_cpu.tolist())), dtype=torch.long)
        if not cache.assign(uniq):
            return self.gather(layer, "k", pages, seq_len), self.gather(layer, "v", pages, seq_len)
        stale = uniq[~cache.fresh[uniq]]
        planes = self.pool.layers[layer]
        if cache.k is None or cache.k.shape[1] < cache.rows:
            # grow by doubling up to the bound; rows already decoded are kept
            n = min(cache.max_rows, max(cache.rows, 2 * (0 if cache.k is None else cache.k.shape[1]), 64))
            hkv, ps = planes["k"].shape[1:3]
            for name in ("k", "v"):
                grown = torch.empty((hkv, n, ps, self.pool.head_dim), dtype=torch.float32, device=pages.device)
                old = getattr(cache, name)
                if old is not None:
                    grown[:, :old.shape[1]] = old
                setattr(cache, name, grown)
        if stale.numel():
            rows = cache.row_of[stale].to(pages.device)
            idx = stale.to(pages.device)
            for name in ("k", "v"):
                sc = planes.get(f"{name}_scale")
                x = self.fmt.decode(planes[name][idx], None if sc is None else sc[idx], rotated=False,
                                    dtype=torch.float32)  # [n, Hkv, page_size, D]
                getattr(cache, name)[:, rows] = x.transpose(0, 1)
            cache.fresh[stale] = True
        rows = cache.row_of[pages_cpu]
        r0, n = int(rows[0]), rows.numel()
        if bool((rows == torch.arange(r0, r0 + n)).all()):
            take = lambda x: x[:, r0:r0 + n]  # noqa: E731 - a view, no copy
        else:
            rows = rows.to(pages.device)
            take = lambda x: x[:, rows]  # noqa: E731
        return tuple(take(x).reshape(x.shape[0], -1, x.shape[-1])[:, :seq_len] for x in (cache.k, cache.v))

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

    def _ring(self, layer: int, meta: StepMetadata) -> tuple[dict, list[int], list[int]] | None:
        """(the layer's ring, each sequence's slot, its ring start) on a windowed step, else None."""
        if not self.pool.windows or meta.state_slots is None:
            return None
        slots = meta.state_slots.tolist()
        starts = meta.window_start_cpu
        if starts is None:
            starts = [self.pool.window_start_cpu[s] if s >= 0 else 0 for s in slots]
        return self.pool.windows[layer], slots, list(starts)

    def write_ring(self, ring: dict, slot: int, k: torch.Tensor, v: torch.Tensor, pos0: int) -> None:
        """Tokens k/v [n, Hkv, D] at positions pos0.. of the sequence in `slot` (its last W matter)."""
        w = ring["k"].shape[2]
        n = k.shape[0]
        first = max(0, n - w)
        rows = torch.arange(pos0 + first, pos0 + n, device=k.device) % w
        ring["k"][slot][:, rows] = k[first:].transpose(0, 1).to(ring["k"].dtype)
        ring["v"][slot][:, rows] = v[first:].transpose(0, 1).to(ring["v"].dtype)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor:
        t, hq, d = q.shape
        hkv = k.shape[1]
        if hq % hkv:
            raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
        group = hq // hkv
        self.store(layer, k, v, meta.slot_mapping)
        starts, seq_lens = meta.plan if isinstance(meta.plan, tuple) else self.plan(meta)
        ring = self._ring(layer, meta)
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
            kb, vb = self.gather_kv(layer, pages, seq_len)  # [Hkv, L, D]
            if ring is not None and ring[1][b] >= 0:
                kb, vb = self._windowed(ring, b, kb, vb, k[q0:q1], v[q0:q1], meta.is_decode)
            # GQA: query head h reads KV head h // group; view q as [Hkv, group, q_len, D]
            qb = q[q0:q1].to(torch.float32).permute(1, 0, 2).reshape(hkv, group, q_len, d)
            # query i sits at absolute position seq_len - q_len + i and sees keys 0..that position
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            kpos = torch.arange(seq_len, device=q.device)
            if q_len == seq_len and q_len > 1:
                # A whole-sequence prefill is top-left causal: SDPA's fused kernel skips the masked half.
                ob = F.scaled_dot_product_attention(qb.reshape(1, hq, q_len, d), kb[None], vb[None],
                                                    is_causal=True, scale=scale, enable_gqa=True)
                out[q0:q1] = ob[0].permute(1, 0, 2).to(q.dtype)
                continue
            rows = max(1, _MAX_SCORE_ELEMS // max(1, hq * seq_len))
            ob = torch.empty(hkv, group, q_len, d, dtype=torch.float32, device=q.device)
            for r0 in range(0, q_len, rows):
                r1 = min(q_len, r0 + rows)
                s = torch.matmul(qb[:, :, r0:r1], kb[:, None].transpose(-1, -2)) * scale  # [Hkv, g, r, L]
                s.masked_fill_(kpos[None, :] > qpos[r0:r1, None], float("-inf"))
                ob[:, :, r0:r1] = torch.matmul(torch.softmax(s, dim=-1), vb[:, None])
            out[q0:q1] = ob.reshape(hq, q_len, d).permute(1, 0, 2).to(q.dtype)
        if ring is not None:
            for b, slot in enumerate(ring[1]):
                q0, q1 = int(starts[b]), int(starts[b + 1])
                if slot >= 0 and q1 > q0:
                    self.write_ring(ring[0], slot, k[q0:q1], v[q0:q1], seq_lens[b] - (q1 - q0))
        return out

    @staticmethod
    def _windowed(ring: tuple, b: int, kb: torch.Tensor, vb: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor,
                  decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """kb/vb [Hkv, L, D] with the model-dtype copies in place of the pages (module docstring)."""
        rk, rv = ring[0]["k"][ring[1][b]], ring[0]["v"][ring[1][b]]  # [Hkv, W, D]
        w, c = rk.shape[1], kb.shape[1] - kn.shape[0]
        wc = max(0, min(w - int(decode), c - ring[2][b]))
        kb, vb = kb.clone(), vb.clone()
        rows = torch.arange(c - wc, c, device=kb.device) % w
        kb[:, c - wc:c], vb[:, c - wc:c] = rk[:, rows].float(), rv[:, rows].float()
        kb[:, c:], vb[:, c:] = kn.transpose(0, 1).float(), vn.transpose(0, 1).float()
        return kb, vb
