"""The window ring of rk4v4-e8w: each sequence slot keeps its last W tokens' K/V in the model dtype.

Layout (``KVCachePool.windows[layer]``): ``k``, ``v`` [num_slots, Hkv, W, D], contiguous; position p of
the sequence in slot s lives at row p % W, so the ring of a sequence of length L holds positions
[L - W, L) once it wrote them. ``pool.window_start[s]`` = v, the first position that sequence wrote
(0 normally, the end of a reused prefix otherwise): attention reads the ring for positions
[L - w, L), w = min(W, L - v), and the pages before that, so it never reads a row it did not write.

* ``ring_write``: scatter new tokens' k/v [n, Hkv, D] to (slot, pos % W); slot -1 = skip (decode padding
  rows). The caller passes at most one token per (slot, row), i.e. only a chunk's last W tokens.
* ``window_decode``: the decode tail, one more flash-decoding partial: each row's query group attends
  its ring's w newest entries; returns (o float32 [B*Hq, D] natural basis, lse float32 [B*Hq] log2 of
  the scaled scores, -inf where w = 0), the form ``decode_reduce`` merges with the page splits.

Both are Triton kernels on CUDA (and under TRITON_INTERPRET=1) with a torch path elsewhere; the torch
``window_decode_ref`` is also their oracle. Graph-safe: shapes and grids depend on B, Hkv, W, D only.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.kernels._common import LOG2E


def _triton_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _ring_write_kernel(K, V, RK, RV, SLOT, POS, sk_t, sk_h, sv_t, sv_h,
                       HKV: tl.constexpr, W: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOT + t)
    if slot >= 0:
        pos = tl.load(POS + t).to(tl.int64)
        row = (slot.to(tl.int64) * HKV + h) * W + pos % W
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(K + t * sk_t + h * sk_h + offs, mask=m)
        tl.store(RK + row * D + offs, x.to(RK.dtype.element_ty), mask=m)
        y = tl.load(V + t * sv_t + h * sv_h + offs, mask=m)
        tl.store(RV + row * D + offs, y.to(RV.dtype.element_ty), mask=m)


def ring_write(ring: dict, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> None:
    """ring {"k", "v"} [S, Hkv, W, D]; k/v [n, Hkv, D]; slots int32 [n] (-1 = skip), pos int64 [n]."""
    rk, rv = ring["k"], ring["v"]
    n = k.shape[0]
    if n == 0:
        return
    _, hkv, w, d = rk.shape
    if _triton_ok(rk):
        if k.stride(2) != 1 or v.stride(2) != 1:
            k, v = k.contiguous(), v.contiguous()
        _ring_write_kernel[(n, hkv)](k, v, rk, rv, slots, pos, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                     HKV=hkv, W=w, D=d, BLOCK_D=triton.next_power_of_2(d))
        return
    keep = slots >= 0
    s, p = slots[keep].long(), pos[keep].long() % w
    rk[s, :, p] = k[keep].to(rk.dtype)
    rv[s, :, p] = v[keep].to(rv.dtype)


@triton.jit
def _window_decode_kernel(Q, RK, RV, SLOT, LENS, WIN, MO, ML, sq_b, sq_h, qk_scale,
                          HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, W: tl.constexpr,
                          D: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(LENS + b)
    w = tl.load(WIN + b)
    slot = tl.maximum(tl.load(SLOT + b), 0).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * sq_b + (h * GROUP + rows)[:, None] * sq_h + offs_d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    j = tl.arange(0, W)
    base = (slot * HKV + h) * W
    # row j holds position n - 1 - ((n - 1 - j) mod W); it is in the window iff that offset < w.
    # Rows outside are not even loaded: the sequence may never have written them.
    valid = ((n - 1 - j + W) % W) < w
    kvmask = valid[:, None] & dmask[None, :]
    kk = tl.load(RK + (base + j)[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
    s = tl.dot(q.to(kk.dtype), tl.trans(kk)) * qk_scale                       # [BLOCK_M, W]
    s = tl.where(valid[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe[:, None])
    l = tl.sum(p, axis=1)
    vv = tl.load(RV + (base + j)[:, None] * D + offs_d[None, :], mask=kvmask, other=0.0)
    o = tl.dot(p.to(vv.dtype), vv) / tl.where(l > 0, l, 1.0)[:, None]
    lse = tl.where(l > 0, m_safe + tl.log2(l), float("-inf"))
    r = b * (HKV * GROUP) + h * GROUP + rows
    tl.store(MO + r[:, None] * D + offs_d[None, :], o, mask=rmask[:, None] & dmask[None, :])
    tl.store(ML + r, lse, mask=rmask)


def window_width(ring_start: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """w [B] int32 = clamp(min(W, L - v), 0) with v = ring_start[slot] (device ops; padding rows: 0)."""
    v = ring_start[slots.clamp(min=0).long()]
    return torch.clamp(torch.minimum(seq_lens - v, torch.full_like(seq_lens, window)), min=0).to(torch.int32)


def window_decode(q: torch.Tensor, ring: dict, slots: torch.Tensor, seq_lens: torch.Tensor, w: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode tail over the ring: q [B, Hq, D]; slots, seq_lens, w int32 [B] -> (o [B*Hq, D], lse [B*Hq])."""
    if not _triton_ok(q):
        return window_decode_ref(q, ring, slots, seq_lens, w, scale)
    bsz, hq, d = q.shape
    rk, rv = ring["k"], ring["v"]
    _, hkv, win, _ = rk.shape
    group = hq // hkv
    mo = torch.empty(bsz * hq, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz * hq, dtype=torch.float32, device=q.device)
    if bsz:
        _window_decode_kernel[(bsz, hkv)](q, rk, rv, slots, seq_lens, w, mo, ml, q.stride(0), q.stride(1),
                                          float(scale) * LOG2E, HKV=hkv, GROUP=group,
                                          BLOCK_M=max(16, triton.next_power_of_2(group)), W=win, D=d,
                                          BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    return mo, ml


def window_decode_ref(q: torch.Tensor, ring: dict, slots: torch.Tensor, seq_lens: torch.Tensor, w: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of ``window_decode`` (float32): the CPU path and the kernel's oracle."""
    bsz, hq, d = q.shape
    rk, rv = ring["k"], ring["v"]
    _, hkv, win, _ = rk.shape
    s_idx = slots.clamp(min=0).long()
    j = torch.arange(win, device=q.device)
    valid = ((seq_lens[:, None].long() - 1 - j[None, :]) % win) < w[:, None].long()        # [B, W]
    keep = valid[:, None, :, None]
    k = torch.where(keep, rk[s_idx].float(), 0.0).repeat_interleave(hq // hkv, dim=1)        # [B, Hq, W, D]
    v = torch.where(keep, rv[s_idx].float(), 0.0).repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("bhd,bhwd->bhw", q.float(), k) * (float(scale) * LOG2E)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp2(s - m)
    l = p.sum(-1)
    o = torch.einsum("bhw,bhwd->bhd", p, v) / torch.where(l > 0, l, 1.0)[..., None]
    lse = torch.where(l > 0, m[..., 0] + torch.log2(torch.where(l > 0, l, 1.0)), float("-inf"))
    return o.reshape(bsz * hq, d), lse.reshape(bsz * hq)


__all__ = ["ring_write", "window_decode", "window_decode_ref", "window_width"]
