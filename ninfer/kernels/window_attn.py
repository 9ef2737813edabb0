"""The window ring of rk4v4-e8w: each sequence slot keeps its last W tokens' K/V in the model dtype.

Layout (``KVCachePool.windows[layer]``): ``k``, ``v`` [num_slots, Hkv, W, D], contiguous; position p of
the sequence in slot s lives at row p % W, so the ring of a sequence of length L holds positions
[L - W, L) once it wrote them. ``pool.window_start[s]`` = v, the first position that sequence wrote
(0 normally, the end of a reused prefix otherwise): attention reads the ring for positions
[L - w, L), w = min(W, L - v), and the pages before that, so it never reads a row it did not write.

* ``ring_write``: scatter new tokens' k/v [n, Hkv, D] to (slot, pos % W); slot -1 = skip. The caller
  passes at most one token per (slot, row), i.e. only a chunk's last W tokens (prefill steps).
* ``window_tail``: the decode tail, one more flash-decoding partial, computed inside
  ``decode_reduce`` on the Triton path (no launch of its own): a query row attends its ring's w
  newest rows, the newest (the token of this step) taken from the fresh k/v, which the group's first
  head writes to the ring.
  Returns (o float32 [64] of the program's dims, natural basis; lse: log2 of the scaled scores,
  -inf where w = 0). ``WindowTail`` bundles its inputs. ``window_partial``: the same as a kernel of
  its own, which ``paged_decode_cuda`` runs on a second stream beside its split kernel.
Triton (CUDA, or TRITON_INTERPRET=1); ``ring_write`` has a torch path for CPU tensors and
``window_decode_ref`` is the tail's torch oracle. Graph-safe: nothing depends on host values.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ninfer.kernels._common import LOG2E  # noqa: F401 (decode_reduce takes it from here)


class WindowTail(NamedTuple):
    """The decode tail's inputs: q [B, Hq, D], this step's k/v [B, Hkv, D], the layer's ring, per row
    the slot, the length L and the window w (int32 [B]), the softmax scale."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ring: dict
    slots: torch.Tensor
    seq_lens: torch.Tensor
    w: torch.Tensor
    scale: float


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
def window_tail(r, offs_d, dmask, Q, KN, VN, RK, RV, SLOT, LENS, WIN, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                qk_scale, D: tl.constexpr, HQ: tl.constexpr, GROUP_SIZE: tl.constexpr, HKV: tl.constexpr,
                W: tl.constexpr, BLOCK_DF: tl.constexpr):
    b = r // HQ
    hq = r % HQ
    h = hq // GROUP_SIZE
    n = tl.load(LENS + b)
    w = tl.load(WIN + b)
    slot_in = tl.load(SLOT + b)
    slot = tl.maximum(slot_in, 0).to(tl.int64)
    j = tl.arange(0, W)
    # row j holds position n - 1 - ((n - 1 - j) mod W); it is in the window iff that offset < w.
    # Rows outside are not even loaded: the sequence may never have written them.
    valid = ((n - 1 - j + W) % W) < w
    newest = (j == (n - 1 + W) % W)[:, None]
    base = (slot * HKV + h) * W
    offs_f = tl.arange(0, BLOCK_DF)
    fmask = offs_f < D
    qv = tl.load(Q + b * sq_b + hq * sq_h + offs_f, mask=fmask, other=0.0).to(tl.float32)
    kt = tl.load(RK + (base + j)[:, None] * D + offs_f[None, :], mask=valid[:, None] & fmask[None, :], other=0.0)
    kf = tl.load(KN + b * skn_b + h * skn_h + offs_f, mask=fmask, other=0.0)
    kt = tl.where(newest, kf[None, :].to(tl.float32), kt.to(tl.float32))
    s = tl.where(valid, tl.sum(kt * qv[None, :], axis=1) * qk_scale, float("-inf"))
    m = tl.max(s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m_safe)
    l = tl.sum(p, axis=0)
    vt = tl.load(RV + (base + j)[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    vb = tl.load(VN + b * svn_b + h * svn_h + offs_d, mask=dmask, other=0.0)
    vt = tl.where(newest, vb[None, :].to(tl.float32), vt.to(tl.float32))
    o = tl.sum(p[:, None] * vt, axis=0) / tl.where(l > 0, l, 1.0)
    lse = tl.where(l > 0, m_safe + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    if (hq % GROUP_SIZE == 0) & (slot_in >= 0) & (n > 0):  # this step's token into the ring
        row = base + (n - 1) % W
        kb = tl.load(KN + b * skn_b + h * skn_h + offs_d, mask=dmask)
        tl.store(RK + row * D + offs_d, kb.to(RK.dtype.element_ty), mask=dmask)
        tl.store(RV + row * D + offs_d, vb.to(RV.dtype.element_ty), mask=dmask)
    return o, lse


@triton.jit
def _window_partial_kernel(WO, WL, Q, KN, VN, RK, RV, SLOT, LENS, WIN, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                           qk_scale, D: tl.constexpr, HQ: tl.constexpr, GROUP_SIZE: tl.constexpr,
                           HKV: tl.constexpr, W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_W: tl.constexpr, PREC: tl.constexpr):
    """One program per (sequence, KV head): the GQA group's rows are the M dimension of two dots, so
    the ring's K and V are read once per KV head (the fused tail reads them once per query row and 64
    dims), BLOCK_W rows at a time with an online softmax. Small on purpose: it shares SMs with the
    split kernel's single wave of blocks."""
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    n = tl.load(LENS + b)
    w = tl.load(WIN + b)
    slot_in = tl.load(SLOT + b)
    slot = tl.maximum(slot_in, 0).to(tl.int64)
    base = (slot * HKV + h) * W
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    g = tl.arange(0, BLOCK_M)
    gmask = g < GROUP_SIZE
    rows = b.to(tl.int64) * HQ + h * GROUP_SIZE + g
    dt = RK.dtype.element_ty
    qt = tl.load(Q + b.to(tl.int64) * sq_b + (h * GROUP_SIZE + g)[:, None] * sq_h + offs_d[None, :],
                 mask=gmask[:, None] & dmask[None, :], other=0.0).to(dt)
    kn = tl.load(KN + b * skn_b + h * skn_h + offs_d, mask=dmask, other=0.0)
    vn = tl.load(VN + b * svn_b + h * svn_h + offs_d, mask=dmask, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in range(0, W, BLOCK_W):
        j = c + tl.arange(0, BLOCK_W)
        valid = ((n - 1 - j + W) % W) < w          # as in window_tail: rows outside are never loaded
        newest = (j == (n - 1 + W) % W)[:, None]
        kt = tl.load(RK + (base + j)[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask[None, :],
                     other=0.0)
        kt = tl.where(newest, kn[None, :].to(dt), kt)
        s = tl.dot(qt, tl.trans(kt), input_precision=PREC) * qk_scale            # [BLOCK_M, BLOCK_W]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        vt = tl.load(RV + (base + j)[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask[None, :],
                     other=0.0)
        vt = tl.where(newest, vn[None, :].to(dt), vt)
        acc = acc * a[:, None] + tl.dot(p.to(dt), vt, input_precision=PREC)
        l = l * a + tl.sum(p, axis=1)
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    tl.store(WO + rows[:, None] * D + offs_d[None, :], o, mask=gmask[:, None] & dmask[None, :])
    tl.store(WL + rows, lse, mask=gmask)
    if (slot_in >= 0) & (n > 0):  # this step's token into the ring
        row = base + (n - 1) % W
        tl.store(RK + row * D + offs_d, kn.to(dt), mask=dmask)
        tl.store(RV + row * D + offs_d, vn.to(dt), mask=dmask)


PARTIAL_CFG = {"block_w": 32, "num_warps": 4}  # window_step times the choices on the GPU


def window_partial(tail: WindowTail) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail as a kernel of its own (natural basis): o float32 [B*Hq, D], lse [B*Hq]; it writes this
    step's token to the ring as the fused tail does. ``decode_reduce(..., partial=(o, lse))`` merges it,
    so it can run on another stream beside the split kernel."""
    q, kn, vn, rk, rv = tail.q, tail.k, tail.v, tail.ring["k"], tail.ring["v"]
    bsz, hq, d = q.shape
    hkv, win = kn.shape[1], rk.shape[2]
    wo = torch.empty(bsz * hq, d, dtype=torch.float32, device=q.device)
    wl = torch.empty(bsz * hq, dtype=torch.float32, device=q.device)
    if bsz:
        _window_partial_kernel[(bsz * hkv,)](
            wo, wl, q, kn, vn, rk, rv, tail.slots, tail.seq_lens, tail.w, q.stride(0), q.stride(1),
            kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), float(tail.scale) * LOG2E,
            D=d, HQ=hq, GROUP_SIZE=hq // hkv, HKV=hkv, W=win, BLOCK_M=max(16, triton.next_power_of_2(hq // hkv)),
            BLOCK_D=triton.next_power_of_2(d), BLOCK_W=min(win, PARTIAL_CFG["block_w"]),
            PREC="ieee" if rk.dtype == torch.float32 else "tf32",  # fp32 rings: exact dots
            num_warps=PARTIAL_CFG["num_warps"])
    return wo, wl


def window_width(ring_start: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, window: int) -> torch.Tensor:
    """w [B] int32 = clamp(min(W, L - v), 0) with v = ring_start[slot] (device ops; padding rows: 0)."""
    v = ring_start[slots.clamp(min=0).long()]
    return torch.clamp(torch.minimum(seq_lens - v, torch.full_like(seq_lens, window)), min=0).to(torch.int32)


def window_decode_ref(q: torch.Tensor, ring: dict, slots: torch.Tensor, seq_lens: torch.Tensor, w: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail over the ring as it is (float32): o [B*Hq, D], lse [B*Hq] (log2 of scaled scores)."""
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


__all__ = ["WindowTail", "ring_write", "window_partial", "window_tail", "window_decode_ref", "window_width"]
