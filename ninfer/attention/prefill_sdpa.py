"""Chunked-prefill attention at tensor-core speed for every KV format: dequantize, then torch SDPA.

Per sequence of the step (its chunk of Tq new tokens already stored, ``ctx`` tokens cached before):

1. Q is rotated once into the stored domain for the rotated formats (word order, ``hadamard.py``;
   the rotation is orthonormal, so scores are unchanged) and laid out as ``[Hkv, g * Tq, D]``:
   the query group folded into the query length, exact for unmasked attention, so the cached part
   needs no GQA expansion of K/V.
2. The cached tokens [0, ctx) are dequantized ``kv_chunk`` tokens at a time into a dense workspace
   (``ninfer/kernels/dequant_pages.py``, one memory-bound pass) and attended without a mask.
3. The chunk's own tokens [ctx, ctx + Tq) are read back from the pages (what is attended is what
   is stored) and attended causally, K/V expanded to the query heads (small: Tq x Tq).
4. Partial results are merged by their log-sum-exp in float32 and the output is rotated back once.

Windowed formats (rk4v4-e8w, ``window=PrefillWindow``): the chunk's own tokens are the fresh K/V the
layer computed (model dtype), not read back from the pages, and the cached part's last
wc = min(W, ctx - v) positions are overwritten in the workspace with the sequence's ring copies (both
put in the workspace's domain). The caller writes the ring only after this call.

SDPA backends (all return the log-sum-exp): CUDA tries cuDNN first and falls back to flash on
any refusal (remembered per shape class); CPU uses aten's CPU flash kernel. The dequantize step is
a Triton kernel, like the Q fold and the merge (``ninfer/kernels/sdpa_io.py``); CPU tests run them
under ``TRITON_INTERPRET=1``, and ``torch_ops=True`` swaps in their torch oracles for fast logic tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.kernels import sdpa_io as IO
from ninfer.kernels.dequant_pages import dequant_pages, dequant_pages_ref
from ninfer.kvcache.formats import KVFormat, get_format

# Cached tokens dequantized per SDPA call: the workspace is 2 x Hkv x KV_CHUNK x D values (512 MiB for
# 8 KV heads x D128 in bf16). One call per 128K context: at 128K it ran 1-5% faster than two 64K calls
# merged (two runs) (H200, 2026-12-01; docs/results/prefill_sdpa_kernels_20261201_h200*.json, "breakdown").
KV_CHUNK = 131072
MIN_CHUNK = 128  # steps whose longest chunk is shorter stay on the Triton prefill kernel
# SDPA backends that refused a shape class (backend, head_dim, dtype) at run time: not tried again.
_REFUSED: set[tuple] = set()
SDPA_ORDER: tuple[str, ...] = ("cudnn", "flash")  # CUDA preference; the bench reorders it to time each


def workspace_bytes(num_heads: int, num_kv_heads: int, head_dim: int, chunk_tokens: int,
                    kv_chunk: int = KV_CHUNK, elem: int = 2) -> int:
    """Peak transient device bytes of one layer's call over a ``chunk_tokens`` chunk (for the memory
    plan), with P = Hq x chunk x D: the K/V workspace (2 Hkv kv_chunk D), and per P the folded Q, the
    cached part's output, the chunk's K/V expanded to the query heads and its output (5 in the
    workspace dtype), the float32 accumulator and its merge temporary when the context spans
    several KV chunks (8 bytes), plus three float32 log-sum-exps per query row and head."""
    p = num_heads * chunk_tokens * head_dim
    kv = 2 * num_kv_heads * max(int(kv_chunk), int(chunk_tokens)) * head_dim * elem
    return kv + p * (5 * elem + 8) + 3 * num_heads * chunk_tokens * 4


def sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             order: tuple[str, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Lq, D], k/v [B, H, Lk, D] (same heads) -> (out [B, H, Lq, D], lse float32 [B, H, Lq]),
    causal aligned top-left (query i sees keys 0..i). Natural-log lse."""
    b, h, lq, _ = q.shape
    if q.device.type != "cuda":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o, lse.reshape(b, h, lq)
    for name in order or SDPA_ORDER:
        key = (name, q.shape[-1], q.dtype)
        if key in _REFUSED:
            continue
        try:
            if name == "cudnn":
                r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                       scale=scale)
            else:
                r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return r[0], r[1].reshape(b, h, lq).float()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # e.g. no cuDNN SDPA engine for this head_dim / build
            _REFUSED.add(key)
    raise RuntimeError(f"no SDPA backend with log-sum-exp runs head_dim {q.shape[-1]} {q.dtype} "
                       f"(tried {', '.join(order or SDPA_ORDER)})")


def _merge(acc: list, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one partial (o, lse) into acc = [o, lse] (float32, or float64 inputs' float64):
    o_total = lerp(o_acc, o, sigmoid(lse - lse_acc)), lse_total = lse_acc + softplus(lse - lse_acc)."""
    dt = torch.promote_types(o.dtype, torch.float32)
    if not acc:
        acc.extend([o.to(dt), lse.to(dt)])
        return
    diff = lse.to(dt) - acc[1]
    acc[0].lerp_(o.to(dt), torch.sigmoid(diff)[..., None])
    acc[1] = acc[1] + F.softplus(diff)


@dataclass
class PrefillWindow:
    """A windowed format's bf16 part of a prefill step: fresh k/v [T, Hkv, D] of the step's tokens, the
    layer's ring {"k", "v"} [slots, Hkv, W, D], each sequence's slot (device int32 [B]) and ring start
    (host ints)."""
    k: torch.Tensor
    v: torch.Tensor
    ring: dict
    slots: torch.Tensor
    starts: list[int]

    def cached_rows(self, b: int, ctx: int) -> int:
        return max(0, min(self.ring["k"].shape[2], ctx - self.starts[b]))

    def ring_values(self, b: int, p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's ring copies of positions [p0, p1): K, V [Hkv, p1 - p0, D]."""
        w = self.ring["k"].shape[2]
        rows = torch.arange(p0, p1, device=self.slots.device) % w
        sl = self.slots[b:b + 1].long()
        return tuple(self.ring[n].index_select(0, sl)[0].index_select(1, rows) for n in ("k", "v"))


def prefill_sdpa(q: torch.Tensor, planes: dict, fmt: KVFormat | str, query_lens: list[int], seq_lens: list[int],
                 block_tables: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                 kv_chunk: int = KV_CHUNK, ws_dtype: torch.dtype | None = None, torch_ops: bool = False,
                 order: tuple[str, ...] | None = None, window: PrefillWindow | None = None) -> torch.Tensor:
    """Causal attention of the flattened new tokens ``q`` [T, Hq, D] (natural order; sequence b owns
    ``query_lens[b]`` rows, in order) over their pages, the chunks already stored. ``seq_lens`` are
    host ints (cached + new), ``block_tables`` [B, max_pages] int32 on q's device. ``ws_dtype``: the
    workspace (SDPA operand) dtype, default q's. ``torch_ops``: the torch oracles instead of the
    Triton dequantize / fold / merge kernels (fast logic tests on CPU). ``order``: SDPA backends to
    try on CUDA. Returns out [T, Hq, D] in q's dtype."""
    fmt = get_format(fmt)
    t, hq, d = q.shape
    hkv = planes["k"].shape[1]
    if hq % hkv or len(query_lens) != len(seq_lens) or sum(query_lens) != t:
        raise ValueError(f"prefill_sdpa: q {list(q.shape)}, {hkv} KV heads, query_lens {query_lens[:8]}..., "
                         f"seq_lens {seq_lens[:8]}... disagree")
    g = hq // hkv
    wdt = ws_dtype or q.dtype
    rot = fmt.rotated
    fold, merge = (IO.fold_q_ref, IO.merge_out_ref) if torch_ops else (IO.fold_q, IO.merge_out)

    def fill(bt: torch.Tensor, tok0: int, n: int, ws: torch.Tensor) -> None:
        if not torch_ops:
            dequant_pages(planes, fmt.name, bt, tok0, n, ws[0], ws[1])
        else:
            ws[0, :, :n], ws[1, :, :n] = dequant_pages_ref(planes, fmt.name, bt, tok0, n, ws.dtype)

    def put(x: torch.Tensor, dst: torch.Tensor) -> None:  # model-dtype K/V [Hkv, n, D] into the workspace
        dst.copy_(IO.to_word_domain(x) if rot else x)

    out = torch.empty_like(q) if out is None else out
    kv_chunk = max(int(kv_chunk), max(query_lens, default=1))
    ws = None
    q0 = 0
    for b, (tq, sl) in enumerate(zip(query_lens, seq_lens)):
        if tq == 0:
            continue
        ctx = sl - tq
        if ctx < 0:
            raise ValueError(f"prefill_sdpa: sequence {b} has {tq} new tokens but seq_len {sl}")
        bt = block_tables[b]
        qf = fold(q[q0:q0 + tq], rot, wdt)  # [Hq, Tq, D] = the folded [Hkv, g * Tq, D] (row gi * Tq + i)
        if ws is None:
            ws = torch.empty(2, hkv, min(kv_chunk, max(seq_lens)), d, dtype=wdt, device=q.device)
        cached = None  # the cached part's (o, lse); several KV chunks merge into a float32 accumulator
        acc: list = []
        r0 = ctx - (window.cached_rows(b, ctx) if window is not None else 0)  # ring copies from r0 on
        for k0 in range(0, ctx, kv_chunk):
            n = min(kv_chunk, ctx - k0)
            fill(bt, k0, n, ws)
            if k0 + n > r0:
                p0 = max(k0, r0)
                for i, x in enumerate(window.ring_values(b, p0, k0 + n)):
                    put(x, ws[i, :, p0 - k0:n])
            o, lse = sdpa_lse(qf.view(1, hkv, g * tq, d), ws[0, None, :, :n], ws[1, None, :, :n], False, scale, order)
            if cached is not None:
                if not acc:
                    _merge(acc, *cached)
                _merge(acc, o[0], lse[0])
            cached = (acc[0], acc[1]) if acc else (o[0], lse[0])
        parts = [] if cached is None else [(cached[0], cached[1], True)]
        if window is None:
            fill(bt, ctx, tq, ws)
        else:  # the chunk's own K/V as the layer computed them
            put(window.k[q0:q0 + tq].transpose(0, 1), ws[0, :, :tq])
            put(window.v[q0:q0 + tq].transpose(0, 1), ws[1, :, :tq])
        kc, vc = (ws[i, :, :tq].repeat_interleave(g, dim=0)[None] for i in (0, 1))  # [1, Hq, Tq, D]
        o, lse = sdpa_lse(qf.view(1, hq, tq, d), kc, vc, True, scale, order)
        parts.append((o[0], lse[0], False))
        merge(parts, out[q0:q0 + tq], g, rot)
        q0 += tq
    return out


def sdpa_prefill_unsupported(ctx) -> str | None:
    """Why this path cannot serve an attention op context (ninfer.attention.selector.OpContext), or None."""
    if ctx.fmt.kernel_code is None:
        return f"format {ctx.fmt.name} has no dequantize kernel"
    if ctx.device.type != "cuda" and not (ctx.device.type == "cpu" and IO._interpreting()):
        return f"needs CUDA (or TRITON_INTERPRET=1 on CPU), device is {ctx.device}"
    if ctx.device.type == "cuda" and ctx.dtype not in (torch.bfloat16, torch.float16) and not ctx.fmt.window:
        return f"SDPA flash / cuDNN need bf16 or fp16, the model runs {ctx.dtype}"
    d = ctx.head_dim
    if d < 64 or d & (d - 1) or d > 256:
        return f"head_dim {d}: the SDPA prefill needs a power of 2 in 64..256"
    return None


def bind_sdpa_prefill(ctx, short_chunks=None):
    """The prefill op ``fn(q, planes, meta, scale)``; steps whose longest chunk is under ``MIN_CHUNK``
    tokens (decode-heavy mixed steps, where per-sequence SDPA calls cost more than they win) go to
    ``short_chunks`` (the Triton kernel) when given."""
    fmt = ctx.fmt
    ws = None
    if fmt.window:  # every chunk needs its fresh K/V and the ring: this path serves all of them
        short_chunks = None  # (an fp32 model on CUDA attends through a bf16 workspace)
        if ctx.device.type == "cuda" and ctx.dtype not in (torch.bfloat16, torch.float16):
            ws = torch.bfloat16

    def prefill(q, planes, meta, scale, window=None):
        if short_chunks is not None and meta.max_query_len < MIN_CHUNK:
            return short_chunks(q, planes, meta, scale)
        qlens = meta.query_lens_cpu if meta.query_lens_cpu is not None else \
            (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        slens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
        return prefill_sdpa(q, planes, fmt, list(qlens), list(slens), meta.block_tables, scale, ws_dtype=ws,
                            window=window)
    return prefill


__all__ = ["prefill_sdpa", "PrefillWindow", "sdpa_lse", "workspace_bytes", "sdpa_prefill_unsupported",
           "bind_sdpa_prefill", "KV_CHUNK"]
