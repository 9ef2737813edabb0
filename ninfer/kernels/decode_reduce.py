"""Final split reduction of paged decode (flash-decoding): log-sum-exp merge of the per-split
partial outputs, with the inverse rotation R = S.H64.S (self-inverse) fused for rotated KV formats.

Input (written by ``paged_decode``'s split kernel), for R = B * Hq query rows and S splits:

* ``mid_o``   float32 [R, S, D]: split s's softmax-normalised partial output of row r (in the H64
  domain for rotated formats, natural dimension order);
* ``mid_lse`` float32 [R, S]: its log2-sum-exp of the scaled scores (``-inf`` for an empty split).

Output ``out`` [R, D] in the caller's dtype: ``sum_s w_s * mid_o[s] / sum_s w_s`` with
``w_s = 2^(lse_s - max lse)``, then ``out = R . out`` per 64-group when ``rotated`` (R = S.H64.S is its own
inverse). A row whose every split is empty (sequence length 0) gets zeros.

``tail`` (a ``window_attn.WindowTail``, rk4v4-e8w, the Triton path): one more partial, computed here
rather than by a launch of its own: each program also attends its query row over its sequence's
ring of the w newest positions (the newest from the fresh k/v, which the group's first head also
writes to the ring), in the natural basis, rotated into the H64 domain when the splits are there,
and merged as split S. ``partial``: that partial computed already (the CUDA path runs
``window_partial`` on a second stream beside its split kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.hadamard import rot64
from ninfer.kernels.window_attn import LOG2E, WindowTail, window_tail

GROUP = 64


@triton.jit
def _decode_reduce_kernel(MO, ML, OUT, S, smo_r, smo_s, sml_r, so_r,
                          Q, KN, VN, RK, RV, SLOT, LENS, WIN, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, qk_scale,
                          WO, WL,
                          D: tl.constexpr, BLOCK_S: tl.constexpr, ROTATED: tl.constexpr, HAS_TAIL: tl.constexpr,
                          HQ: tl.constexpr, GROUP_SIZE: tl.constexpr, HKV: tl.constexpr, W: tl.constexpr,
                          BLOCK_DF: tl.constexpr):
    """One program per (row, 64-dim block): all splits of that block are loaded at once (one
    [BLOCK_S, 64] tile per step, normally a single step), merged, and rotated back in registers."""
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs_d = blk * 64 + tl.arange(0, 64)
    dmask = offs_d < D
    m = tl.max(tl.full([2], float("-inf"), tl.float32), axis=0)  # fp32 scalars (loop-carried)
    l = tl.sum(tl.zeros([2], tl.float32), axis=0)
    acc = tl.zeros([64], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        smask = offs_s < S
        lse = tl.load(ML + r * sml_r + offs_s, mask=smask, other=float("-inf"))
        o = tl.load(MO + r * smo_r + offs_s[:, None] * smo_s + offs_d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        safe = m_new != float("-inf")
        a = tl.where(safe, tl.exp2(m - m_new), 0.0)
        w = tl.where(safe, tl.exp2(lse - m_new), 0.0)
        acc = acc * a + tl.sum(o * w[:, None], axis=0)
        l = l * a + tl.sum(w, axis=0)
        m = m_new
    if HAS_TAIL:
        if HAS_TAIL == 2:  # computed before, by window_partial
            ot = tl.load(WO + r * D + offs_d, mask=dmask, other=0.0)
            lt = tl.load(WL + r)
        else:
            ot, lt = window_tail(r, offs_d, dmask, Q, KN, VN, RK, RV, SLOT, LENS, WIN, sq_b, sq_h, skn_b, skn_h,
                                 svn_b, svn_h, qk_scale, D, HQ, GROUP_SIZE, HKV, W, BLOCK_DF)
        if ROTATED:
            ot = tl.sum(ot[:, None] * rot64(tl.float32), axis=0)
        m_new = tl.maximum(m, lt)
        safe = m_new != float("-inf")
        a = tl.where(safe, tl.exp2(m - m_new), 0.0)
        wt = tl.where(safe, tl.exp2(lt - m_new), 0.0)
        acc = acc * a + ot * wt
        l = l * a + wt
    out = acc / tl.where(l > 0, l, 1.0)
    if ROTATED:
        # out_nat[i] = sum_j out_rot[j] R[j, i]: a [64] x [64, 64] product, broadcast in registers.
        out = tl.sum(out[:, None] * rot64(tl.float32), axis=0)
    tl.store(OUT + r * so_r + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


def decode_reduce(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, *, rotated: bool,
                  tail: WindowTail | None = None,
                  partial: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Merge splits: ``mid_o`` float32 [R, S, D], ``mid_lse`` float32 [R, S] (log2 domain) into
    ``out`` [R, D] (any float dtype, written in place and returned); ``rotated`` applies the format's
    rotation R per 64-group after the merge (D must then be a multiple of 64); ``tail``: the window
    ring's partial, merged too (module docstring); ``partial``: that partial computed already
    (``window_partial``'s o [R, D], lse [R], natural basis), merged instead of ``tail``.

    Grid ``(R, cdiv(D, 64))``: every program loads all S partials of its 64 dims at once, so the
    time does not grow with S the way a loop of dependent loads over S would."""
    if mid_o.dim() != 3 or mid_lse.shape != mid_o.shape[:2]:
        raise ValueError(f"decode_reduce: mid_o {list(mid_o.shape)} must be [R, S, D] and mid_lse [R, S], "
                         f"got mid_lse {list(mid_lse.shape)}")
    if mid_o.dtype != torch.float32 or mid_lse.dtype != torch.float32:
        raise ValueError("decode_reduce: mid_o / mid_lse must be float32")
    r, s, d = mid_o.shape
    if out.shape != (r, d) or not out.is_floating_point():
        raise ValueError(f"decode_reduce: out must be a float [{r}, {d}], got {out.dtype}{list(out.shape)}")
    if mid_o.stride(2) != 1 or mid_lse.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("decode_reduce: last dims must be contiguous")
    if rotated and d % GROUP:
        raise ValueError(f"decode_reduce: rotated output needs head_dim a multiple of 64, got {d}")
    if r == 0:
        return out
    block_s = min(128, triton.next_power_of_2(max(1, s)))
    if partial is not None:
        if tail is not None or partial[0].shape != (r, d) or partial[1].shape != (r,):
            raise ValueError("decode_reduce: partial must be o [R, D], lse [R], and not given with tail")
        wo, wl = (p.float().contiguous() for p in partial)
    else:
        wo, wl = mid_o, mid_lse
    if tail is None:
        t, geo = (mid_o,) * 8, dict(HQ=1, GROUP_SIZE=1, HKV=1, W=16, BLOCK_DF=16)
        strides, qk = (0,) * 6, 0.0
    else:
        q, kn, vn = tail.q, tail.k, tail.v
        rk, rv = tail.ring["k"], tail.ring["v"]
        if q.shape[0] * q.shape[1] != r or kn.stride(2) != 1 or vn.stride(2) != 1 or not rk.is_contiguous():
            raise ValueError("decode_reduce: the tail's q rows must be R, k/v and the ring contiguous per row")
        t = (q, kn, vn, rk, rv, tail.slots, tail.seq_lens, tail.w)
        strides = (q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1))
        geo = dict(HQ=q.shape[1], GROUP_SIZE=q.shape[1] // kn.shape[1], HKV=kn.shape[1], W=rk.shape[2],
                   BLOCK_DF=triton.next_power_of_2(d))
        qk = float(tail.scale) * LOG2E
    _decode_reduce_kernel[(r, triton.cdiv(d, 64))](mid_o, mid_lse, out, s, mid_o.stride(0), mid_o.stride(1),
                                                   mid_lse.stride(0), out.stride(0), *t, *strides, qk, wo, wl,
                                                   D=d, BLOCK_S=block_s, ROTATED=rotated,
                                                   HAS_TAIL=2 if partial is not None else int(tail is not None),
                                                   **geo,
                                                   num_warps=4 if tail is None else 8)  # a [W, D] ring tile
    return out
