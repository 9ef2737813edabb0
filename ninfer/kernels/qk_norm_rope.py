"""q/k per-head RMSNorm (optional: Qwen3's q_norm/k_norm, or Qwen3.5's offset norm) + rotate-half
RoPE + the key centring transform (optional, kvcache/centering.py), q and k in one launch.

Grid ``(T, cdiv(Hq, BH) + cdiv(Hkv, BH))``: one program per token and tile of BH heads (a
[BH, D] block, ~512 elements); the first tiles do q, the rest k.
q/k may be strided views (split from the fused qkv output); the results are new contiguous
[T, H, D] tensors (or given contiguous buffers). One launch replaces the ~30 small torch kernels
of two RMSNorms and two ``apply_rotary`` calls.

Numerics, element d of a head (R = rotary dim <= D, half = R/2, p = the rotate-half partner of d):
the norm as ``rmsnorm.py`` (same rounding points, same caveat on the mean's summation order);
then, as ``ninfer/layers/rotary.py`` ``apply_rotary`` in the dtype of x, each op rounded like torch:
    c, s = cos/sin[t, d] rounded to x.dtype
    out  = rnd(rnd(x[d] * c) + rnd(sign(d) * x[p] * s))     sign = -1 for d < half, +1 otherwise
and x[d] unchanged for d >= R. Products of two <=16-bit floats are exact in float32 and
torch adds two bf16/fp16 values in float32 before rounding, so without the norm the result is
bit-exact (fp32 too: no FMA contraction). The offset norm (``OffsetRMSNorm``) rounds once:
rnd(x * rstd * (1 + w)), all in float32, as torch's float32 ops then ``.to(dtype)``.

Key centring (``KeyTransform``: q * s, (k - m) * (1/s), its tensors in x.dtype) after RoPE, as
torch's two or one elementwise ops in x.dtype round:
    q' = rnd(y * qs[h, d])      k' = rnd(rnd(y - m[h, d]) * ks[h, d])
so the fused result equals rope-then-``KeyTransform`` bit for bit (a difference/product of two
<=16-bit floats computed in float32 and rounded once is what torch's bf16/fp16 ops do; fp32
computes the same float32 ops).

cos/sin come from ``RotaryEmbedding.cos_sin`` (float32, ~7 launches once per step, shared by every
layer), not from positions in here: the float32 sin/cos of angles up to 10^5-10^6 radians would
have to equal torch's to the bit (libdevice vs torch's CUDA code; numpy vs torch's CPU code under
the interpreter), which the tests here cannot establish, and recomputing them in every layer's
programs would spend more than the launches it saves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.rmsnorm import FLOAT_DTYPES, check_out, rmsnorm_ref, round_to, row_rstd

TILE = 512  # elements per program: 4 heads of 128 (Qwen3-8B decode: 8 q + 2 k programs)


@triton.jit
def _heads(x_ptr, sxt, sxh, sxd, w_ptr, c_ptr, sct, scd, s_ptr, sst, ssd, sh_ptr, sc_ptr, o_ptr, t, h0, eps,
           H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BLOCK_D: tl.constexpr,
           NORM: tl.constexpr, SHIFT: tl.constexpr, SCALE: tl.constexpr, CUDA: tl.constexpr):
    """Heads h0 .. h0+BH-1 of token t: a [BH, BLOCK_D] tile. NORM 0: none, 1: x_hat * w, 2: x_hat * (1 + w);
    SHIFT/SCALE: subtract sh_ptr[h, d], then multiply by sc_ptr[h, d] (contiguous [H, D])."""
    HALF: tl.constexpr = R // 2
    DT: tl.constexpr = x_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    hh = h0 + tl.arange(0, BH)
    m = (hh < H)[:, None] & (d < D)[None, :]
    p = tl.where(d < HALF, d + HALF, tl.where(d < R, d - HALF, d))  # rotate-half partner
    rows = x_ptr + t * sxt + hh[:, None] * sxh
    x = tl.load(rows + d[None, :] * sxd, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(rows + p[None, :] * sxd, mask=m, other=0.0).to(tl.float32)  # same rows again (L1)
    if NORM > 0:
        rstd = row_rstd(x, D, eps, CUDA)[:, None]
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + p, mask=d < D, other=0.0).to(tl.float32)[None, :]
        if NORM == 1:
            x = round_to(round_to(x * rstd, DT) * w, DT)
            xp = round_to(round_to(xp * rstd, DT) * wp, DT)
        else:
            x = round_to(x * rstd * (1.0 + w), DT)
            xp = round_to(xp * rstd * (1.0 + wp), DT)
    rm = d < R
    c = round_to(tl.load(c_ptr + t * sct + d * scd, mask=rm, other=0.0), DT)[None, :]
    s = round_to(tl.load(s_ptr + t * sst + d * ssd, mask=rm, other=0.0), DT)[None, :]
    rot = tl.where((d < HALF)[None, :], -xp, xp)
    y = round_to(round_to(x * c, DT) + round_to(rot * s, DT), DT)
    y = tl.where(rm[None, :], y, x)
    hd = hh[:, None] * D + d[None, :]
    if SHIFT:
        y = round_to(y - tl.load(sh_ptr + hd, mask=m, other=0.0).to(tl.float32), DT)
    if SCALE:
        y = round_to(y * tl.load(sc_ptr + hd, mask=m, other=0.0).to(tl.float32), DT)
    tl.store(o_ptr + t * H * D + hd, y, mask=m)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, sqt, sqh, sqd, k_ptr, skt, skh, skd, qw_ptr, kw_ptr,
                         c_ptr, sct, scd, s_ptr, sst, ssd, qs_ptr, km_ptr, ks_ptr, qo_ptr, ko_ptr, eps,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                         BH: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, CENTRE: tl.constexpr,
                         CUDA: tl.constexpr):
    NQB: tl.constexpr = (HQ + BH - 1) // BH
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    if b < NQB:
        _heads(q_ptr, sqt, sqh, sqd, qw_ptr, c_ptr, sct, scd, s_ptr, sst, ssd, qs_ptr, qs_ptr, qo_ptr, t, b * BH,
               eps, HQ, D, R, BH, BLOCK_D, NORM, False, CENTRE, CUDA)
    else:
        _heads(k_ptr, skt, skh, skd, kw_ptr, c_ptr, sct, scd, s_ptr, sst, ssd, km_ptr, ks_ptr, ko_ptr, t,
               (b - NQB) * BH, eps, HKV, D, R, BH, BLOCK_D, NORM, CENTRE, CENTRE, CUDA)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 *, offset_norm: bool = False, q_scale: torch.Tensor | None = None,
                 k_shift: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (any strides, one dtype); cos/sin [T, R] float32 (R even, <= D);
    q_weight/k_weight [D] in q's dtype, both or neither (``offset_norm``: they are offsets from 1).
    q_scale [Hq, D], k_shift and k_scale [Hkv, D] in q's dtype, all or none: q' = q * q_scale,
    k' = (k - k_shift) * k_scale after RoPE. Returns contiguous (q_out, k_out)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"qk_norm_rope: q {list(q.shape)} / k {list(k.shape)} must be [T, Hq, D] / [T, Hkv, D]")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"qk_norm_rope: q/k must share an fp16/bf16/fp32 dtype, got {q.dtype}/{k.dtype}")
    t, hq, d = q.shape
    hkv = k.shape[1]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != t or cos.dtype != torch.float32 \
            or sin.dtype != torch.float32:
        raise ValueError(f"qk_norm_rope: cos/sin must be float32 [{t}, R], got {cos.dtype}{list(cos.shape)} / "
                         f"{sin.dtype}{list(sin.shape)}")
    r = cos.shape[1]
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"qk_norm_rope: rotary dim {r} must be even and in (0, head_dim={d}]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: give both q_weight and k_weight, or neither")
    if q_weight is not None:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w.shape != (d,) or w.dtype != q.dtype or w.device != q.device:
                raise ValueError(f"qk_norm_rope: {name} must be {q.dtype}[{d}] on {q.device}, "
                                 f"got {w.dtype}{list(w.shape)} on {w.device}")
    centre = (q_scale, k_shift, k_scale)
    if any(x is None for x in centre) and any(x is not None for x in centre):
        raise ValueError("qk_norm_rope: give q_scale, k_shift and k_scale together, or none of them")
    if q_scale is not None:
        for name, x, h in (("q_scale", q_scale, hq), ("k_shift", k_shift, hkv), ("k_scale", k_scale, hkv)):
            if x.shape != (h, d) or x.dtype != q.dtype or x.device != q.device:
                raise ValueError(f"qk_norm_rope: {name} must be {q.dtype}[{h}, {d}] on {q.device}, "
                                 f"got {x.dtype}{list(x.shape)} on {x.device}")
    if any(x.device != q.device for x in (k, cos, sin)):
        raise ValueError("qk_norm_rope: q, k, cos and sin must be on one device")
    q_out = check_out(q_out, q.shape, q.dtype, q.device, "qk_norm_rope", "q_out")
    k_out = check_out(k_out, k.shape, k.dtype, k.device, "qk_norm_rope", "k_out")
    if t == 0:
        return q_out, k_out
    has_norm = q_weight is not None
    qw = q_weight.contiguous() if has_norm else q_out  # placeholder pointer when there is no norm
    kw = k_weight.contiguous() if has_norm else q_out
    qs, km, ks = (x.contiguous() for x in centre) if q_scale is not None else (q_out, q_out, q_out)
    block_d = triton.next_power_of_2(d)
    bh = max(1, min(TILE // block_d, triton.next_power_of_2(max(hq, hkv))))
    grid = (t, triton.cdiv(hq, bh) + triton.cdiv(hkv, bh))
    _qk_norm_rope_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2), k, k.stride(0), k.stride(1), k.stride(2), qw, kw,
        cos, cos.stride(0), cos.stride(1), sin, sin.stride(0), sin.stride(1), qs, km, ks, q_out, k_out, float(eps),
        HQ=hq, HKV=hkv, D=d, R=r, BH=bh, BLOCK_D=block_d, NORM=(2 if offset_norm else 1) if has_norm else 0,
        CENTRE=q_scale is not None, CUDA=q.is_cuda,
        num_warps=max(1, min(8, bh * block_d // 128)), enable_fp_fusion=False)
    return q_out, k_out


def qk_norm_rope_ref(q, k, cos, sin, q_weight=None, k_weight=None, eps=1e-6):
    """The model's torch path: q_norm/k_norm (when given), then ``apply_rotary`` (imported here:
    ninfer.layers imports this module)."""
    from ninfer.layers.rotary import apply_rotary
    if q_weight is not None:
        q, k = rmsnorm_ref(q, q_weight, eps), rmsnorm_ref(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
