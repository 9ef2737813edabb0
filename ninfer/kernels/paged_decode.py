"""Paged decode attention (split-KV / flash-decoding) over the KV pool's planes, every format.

One program per (sequence, KV head, split) handles the whole GQA group of query rows as the small
dimension of ``tl.dot``, so every K/V byte is read once per step and shared by the group. K is
the A operand (tokens are the long M dimension, no transpose of the big tile). One page (64
tokens) is one tile. The grid is ``(B, Hkv, num_splits)`` with ``num_splits`` fixed from the GPU's
SM count and the page-table width (never from this step's lengths), so decode can be captured in a
CUDA graph; each program derives its page range from the device-side ``seq_lens``.

Formats (``docs/ARCHITECTURE.md`` "4-bit data layout" and "KV pool"):

* ``auto`` / ``bf16``: K/V tiles go straight into ``tl.dot``.
* ``int8``: per 64-group batched dots; the K group scale multiplies the group's partial score, the
  V group scale is folded into P (``P_g = P * s_v[:, g]``), so the int8 -> fp16 conversion is the
  only element-wise work.
* ``rk4v4`` / ``rk4v4-e8`` (H64-rotated): Q is rotated (and permuted, see below) in the program by
  one small exact dot with H64; scores are unchanged by the rotation. The packed bytes of group g
  are used as they are: low nibbles and high nibbles are two [T, 32] operands whose columns map to
  rotated dimensions ``16b + w`` and ``16b + 8 + w`` (byte ``4w + b``), and Q is permuted to match,
  so there is no re-interleaving of the tile. Offset-binary nibbles u = n + 8 enter the dot as
  they are; the ``-8`` folds into ``-8 * sum(q)`` (K) and ``-8 * sum(P)`` (V).
  For rk4v4-e8 the lattice work stays out of the element path: per 32-bit word (one E8 block)
  ``c`` = coset bit, ``par`` = parity of n0..n6, and ``q.p = q.n_stored + (par - c) q_7 + (c/2)
  sum_block q`` -- two per-word features against per-word Q weights in one extra K=16 dot. V gets
  the same features (``sum_t P (par - c)`` to the dimension of nibble 7, ``sum_t P c/2`` to all 8
  dimensions of the word), added once per split.
  The partial outputs stay in the H64 domain; ``decode_reduce`` undoes the rotation once.

Backends: this Triton kernel is the portable path. On NVIDIA GPUs (sm_80+, nvcc present) the
int8 / rk4v4 / rk4v4-e8 formats also have a CUDA C++ split kernel (section "CUDA C++ path"
below), 3-6x faster than the Triton one at 128K (docs/KERNELS.md, docs/BENCHMARKS.md);
``backend="auto"`` (the default) picks it wherever it can run and falls back to Triton otherwise.
Both write the same split partials, merged by ``decode_reduce``.

``paged_decode_ref`` (bottom) is the independent torch oracle: it decodes the planes with the
format registry's reference decode (``ninfer.kvcache.formats``) and attends in float64.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import torch
import triton
import triton.language as tl

from ninfer.kernels.decode_reduce import decode_reduce
from ninfer.kvcache.formats import GROUP, get_format

FMT_PLAIN, FMT_INT8, FMT_RK4, FMT_E8 = 0, 1, 2, 3
LOG2E = 1.4426950408889634


def fmt_code(fmt) -> int:
    if not fmt.has_scales:
        return FMT_PLAIN
    if fmt.e8_lattice:
        return FMT_E8
    return FMT_RK4 if fmt.packed else FMT_INT8


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _parity6(p):
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return p & 1


@triton.jit
def _hval(j, i):
    """R[j, i] of the format's rotation R = S.H64.S (``ninfer/kvcache/hadamard.py``) as float32:
    +-1/8 with sign parity(j & i) ^ f(j) ^ f(i), f(x) = parity((x & (x >> 1)) & 0b010101)."""
    p = _parity6(j & i) ^ _parity6((j & (j >> 1)) & 21) ^ _parity6((i & (i >> 1)) & 21)
    return tl.where(p == 1, -0.125, 0.125)


@triton.jit
def _e8_features(w, fcol):
    """Per-word E8 features; w uint32 [..., 16] where column f holds word f % 8.
    Column f < 8: par - c (true n7 minus stored n7); column f >= 8: c / 2."""
    c = (w >> 28) & 1
    # xor of the 8 stored nibble low bits (bits 0, 4, ..., 28) = par ^ c: the multiply sums the
    # eight bits into the top nibble (each column sum <= 8 < 16, no carries between nibbles).
    t = ((w & 0x11111111) * 0x11111111) >> 28
    par = (t ^ c) & 1
    f1 = par.to(tl.float32) - c.to(tl.float32)
    return tl.where(fcol < 8, f1, c.to(tl.float32) * 0.5)


# ----------------------------------------------------------------------------- split kernel
@triton.jit
def _paged_decode_split_kernel(
        Q, KD, KW, KS, VD, VW, VS, BT, SL, MO, ML,
        sq_b, sq_h,
        sk_p, sk_h, sk_t, skw_p, skw_h, skw_t, sks_p, sks_h, sks_t,
        sv_p, sv_h, sv_t, svw_p, svw_h, svw_t, svs_p, svs_h, svs_t,
        sbt_b, smo_r, smo_s, sml_r,
        qk_scale, NUM_SPLITS,
        HQ: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        D: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
        FMT: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SL + b)
    n_pages = tl.cdiv(seq_len, PAGE)
    per = tl.cdiv(n_pages, NUM_SPLITS)
    p_lo = split * per
    p_hi = tl.minimum(p_lo + per, n_pages)

    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < GROUP_SIZE
    h0 = kvh * GROUP_SIZE
    rows = b * HQ + h0 + offs_m
    offs_t = tl.arange(0, PAGE)
    q_base = Q + b * sq_b + h0 * sq_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)

    if FMT == 0:
        # ------------------------------------------------------------ unquantized planes
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        qT = tl.load(q_base + offs_m[None, :] * sq_h + offs_d[:, None],
                     mask=mmask[None, :] & dmask[:, None], other=0.0).to(KD.dtype.element_ty)  # [D, M]
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for i in range(p_lo, p_hi):
            page = tl.load(BT + b * sbt_b + i).to(tl.int64)
            kt = tl.load(KD + page * sk_p + kvh * sk_h + offs_t[:, None] * sk_t + offs_d[None, :],
                         mask=dmask[None, :], other=0.0)
            if INTERPRET:  # the CPU interpreter's dot mishandles bf16 operands: same math in fp32
                s = tl.dot(kt.to(tl.float32), qT.to(tl.float32)) * qk_scale
            else:
                s = tl.dot(kt, qT) * qk_scale  # [T, M]
            s = tl.where((i * PAGE + offs_t)[:, None] < seq_len, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            vt = tl.load(VD + page * sv_p + kvh * sv_h + offs_t[:, None] * sv_t + offs_d[None, :],
                         mask=dmask[None, :] & ((i * PAGE + offs_t)[:, None] < seq_len), other=0.0)
            if INTERPRET:
                acc = acc * alpha[:, None] + tl.dot(tl.trans(p).to(vt.dtype).to(tl.float32), vt.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(tl.trans(p).to(vt.dtype), vt)
            m_i = m_new
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        tl.store(MO + rows[:, None] * smo_r + split * smo_s + offs_d[None, :], acc * inv_l[:, None],
                 mask=mmask[:, None] & dmask[None, :])
    elif FMT == 1:
        # ------------------------------------------------------------ int8, fp16 scale per 64
        og = tl.arange(0, BLOCK_G)
        gmask = og < G
        oc = tl.arange(0, 64)
        qT = tl.load(q_base + og[:, None, None] * 64 + oc[None, :, None] + offs_m[None, None, :] * sq_h,
                     mask=gmask[:, None, None] & mmask[None, None, :], other=0.0).to(tl.float16)  # [G, 64, M]
        acc = tl.zeros([BLOCK_G, BLOCK_M, 64], tl.float32)
        goff_k = og[:, None, None] * 64 + offs_t[None, :, None] * sk_t + oc[None, None, :]
        goff_v = og[:, None, None] * 64 + offs_t[None, :, None] * sv_t + oc[None, None, :]
        for i in range(p_lo, p_hi):
            page = tl.load(BT + b * sbt_b + i).to(tl.int64)
            kt = tl.load(KD + page * sk_p + kvh * sk_h + goff_k, mask=gmask[:, None, None], other=0)
            s3 = tl.dot(kt.to(tl.float16), qT)  # [G, T, M]
            ks = tl.load(KS + page * sks_p + kvh * sks_h + offs_t[None, :] * sks_t + og[:, None],
                         mask=gmask[:, None], other=0.0).to(tl.float32)  # [G, T]
            s = tl.sum(s3 * ks[:, :, None], axis=0) * qk_scale
            s = tl.where((i * PAGE + offs_t)[:, None] < seq_len, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            vs = tl.load(VS + page * svs_p + kvh * svs_h + offs_t[None, :] * svs_t + og[:, None],
                         mask=gmask[:, None] & ((i * PAGE + offs_t)[None, :] < seq_len),
                         other=0.0).to(tl.float32)  # [G, T]; unwritten slots read as 0
            p3 = (tl.trans(p)[None, :, :] * vs[:, None, :]).to(tl.float16)  # [G, M, T]
            vt = tl.load(VD + page * sv_p + kvh * sv_h + goff_v, mask=gmask[:, None, None], other=0)
            acc = acc * alpha[None, :, None] + tl.dot(p3, vt.to(tl.float16))
            m_i = m_new
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        tl.store(MO + rows[None, :, None] * smo_r + split * smo_s + og[:, None, None] * 64 + oc[None, None, :],
                 acc * inv_l[None, :, None], mask=gmask[:, None, None] & mmask[None, :, None])
    else:
        # ------------------------------------------------------------ rk4v4 / rk4v4-e8 (rotated, packed)
        og = tl.arange(0, BLOCK_G)
        gmask = og < G
        oc = tl.arange(0, 32)      # byte 4w + b of a group
        oj = tl.arange(0, 64)      # natural dimension inside a group
        of = tl.arange(0, 16)      # E8 feature column
        dim_lo = 16 * (oc % 4) + oc // 4  # rotated dimension of byte oc's low nibble (high: + 8)
        # Q: natural [G, 64, M] -> rotated and permuted per byte column, exact fp32 dots.
        q3 = tl.load(q_base + og[:, None, None] * 64 + oj[None, :, None] + offs_m[None, None, :] * sq_h,
                     mask=gmask[:, None, None] & mmask[None, None, :], other=0.0).to(tl.float32)
        h_lo = _hval(oj[None, :], dim_lo[:, None])          # [32, 64]: row c = H64 column dim_lo(c)
        h_hi = _hval(oj[None, :], dim_lo[:, None] + 8)
        qlo = tl.dot(tl.broadcast_to(h_lo[None, :, :], [BLOCK_G, 32, 64]), q3, input_precision="ieee")
        qhi = tl.dot(tl.broadcast_to(h_hi[None, :, :], [BLOCK_G, 32, 64]), q3, input_precision="ieee")
        qlo = qlo.to(tl.float16)
        qhi = qhi.to(tl.float16)
        qs = tl.sum(qlo.to(tl.float32), axis=1) + tl.sum(qhi.to(tl.float32), axis=1)  # [G, M]
        fcol = of[None, None, :]
        if FMT == 3:
            # rows f < 8: H64 column 56 + f (q of nibble 7 of word f); rows f >= 8: sum_j H64 column 8j + f-8.
            wf = of[:, None] % 8
            h_f = tl.zeros([16, 64], tl.float32)
            for jj in tl.static_range(8):
                h_f += tl.where((of[:, None] >= 8) | (jj == 7), _hval(oj[None, :], 8 * jj + wf), 0.0)
            qf = tl.dot(tl.broadcast_to(h_f[None, :, :], [BLOCK_G, 16, 64]), q3,
                        input_precision="ieee").to(tl.float16)  # [G, 16, M]
            accf = tl.zeros([BLOCK_G, BLOCK_M, 16], tl.float32)
            goff_kw = og[:, None, None] * 8 + offs_t[None, :, None] * skw_t + (of % 8)[None, None, :]
            goff_vw = og[:, None, None] * 8 + offs_t[None, :, None] * svw_t + (of % 8)[None, None, :]
        acc_lo = tl.zeros([BLOCK_G, BLOCK_M, 32], tl.float32)
        acc_hi = tl.zeros([BLOCK_G, BLOCK_M, 32], tl.float32)
        psum = tl.zeros([BLOCK_G, BLOCK_M], tl.float32)
        goff_k = og[:, None, None] * 32 + offs_t[None, :, None] * sk_t + oc[None, None, :]
        goff_v = og[:, None, None] * 32 + offs_t[None, :, None] * sv_t + oc[None, None, :]
        for i in range(p_lo, p_hi):
            page = tl.load(BT + b * sbt_b + i).to(tl.int64)
            kb = tl.load(KD + page * sk_p + kvh * sk_h + goff_k, mask=gmask[:, None, None], other=0)
            s3 = tl.dot((kb & 15).to(tl.float16), qlo) + tl.dot((kb >> 4).to(tl.float16), qhi)  # [G, T, M]
            if FMT == 3:
                kw = tl.load(KW + page * skw_p + kvh * skw_h + goff_kw, mask=gmask[:, None, None], other=0)
                kf = _e8_features(kw.to(tl.uint32, bitcast=True), fcol).to(tl.float16)
                s3 += tl.dot(kf, qf)
            ks = tl.load(KS + page * sks_p + kvh * sks_h + offs_t[None, :] * sks_t + og[:, None],
                         mask=gmask[:, None], other=0.0).to(tl.float32)  # [G, T]
            s = tl.sum((s3 - 8.0 * qs[:, None, :]) * ks[:, :, None], axis=0) * qk_scale
            s = tl.where((i * PAGE + offs_t)[:, None] < seq_len, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            vs = tl.load(VS + page * svs_p + kvh * svs_h + offs_t[None, :] * svs_t + og[:, None],
                         mask=gmask[:, None] & ((i * PAGE + offs_t)[None, :] < seq_len),
                         other=0.0).to(tl.float32)  # [G, T]; unwritten slots read as 0
            p3 = (tl.trans(p)[None, :, :] * vs[:, None, :]).to(tl.float16)  # [G, M, T]
            vb = tl.load(VD + page * sv_p + kvh * sv_h + goff_v, mask=gmask[:, None, None], other=0)
            acc_lo = acc_lo * alpha[None, :, None] + tl.dot(p3, (vb & 15).to(tl.float16))
            acc_hi = acc_hi * alpha[None, :, None] + tl.dot(p3, (vb >> 4).to(tl.float16))
            psum = psum * alpha[None, :] + tl.sum(p3.to(tl.float32), axis=2)
            if FMT == 3:
                vw = tl.load(VW + page * svw_p + kvh * svw_h + goff_vw, mask=gmask[:, None, None], other=0)
                vf = _e8_features(vw.to(tl.uint32, bitcast=True), fcol).to(tl.float16)
                accf = accf * alpha[None, :, None] + tl.dot(p3, vf)
            m_i = m_new
        lo = acc_lo - 8.0 * psum[:, :, None]
        hi = acc_hi - 8.0 * psum[:, :, None]
        if FMT == 3:
            # Spread the per-word terms onto byte columns c = 4w + b: c/2 to every nibble of word w,
            # (par - c) to the high nibble of byte 3 (nibble 7). Selection matrices, exact dots.
            fr = of[:, None]
            cw = oc[None, :] // 4
            sel_lo = tl.where(fr == 8 + cw, 1.0, 0.0)
            sel_hi = tl.where((fr == 8 + cw) | ((fr == cw) & (oc[None, :] % 4 == 3)), 1.0, 0.0)
            lo += tl.dot(accf, tl.broadcast_to(sel_lo[None, :, :], [BLOCK_G, 16, 32]), input_precision="ieee")
            hi += tl.dot(accf, tl.broadcast_to(sel_hi[None, :, :], [BLOCK_G, 16, 32]), input_precision="ieee")
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        optr = MO + rows[None, :, None] * smo_r + split * smo_s + og[:, None, None] * 64 + dim_lo[None, None, :]
        omask = gmask[:, None, None] & mmask[None, :, None]
        tl.store(optr, lo * inv_l[None, :, None], mask=omask)
        tl.store(optr + 8, hi * inv_l[None, :, None], mask=omask)

    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(ML + rows * sml_r + split, lse, mask=mmask)


# ----------------------------------------------------------------------------- host side
_SM_COUNT: dict[int, int] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU about twice, from the SM count
    and the page-table width only (both fixed for a captured graph), at most one split per page."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        target = 2 * _SM_COUNT[idx]
    else:
        target = 4
    s = triton.cdiv(target, max(1, batch * num_kv_heads))
    return int(max(1, min(s, max_pages, 512)))


def _planes(planes, fmt, which: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(planes, torch.Tensor):
        data, sc = planes, None
    elif isinstance(planes, dict):
        data, sc = planes[which], planes.get(f"{which}_scale")
    else:
        seq = tuple(planes)
        data, sc = seq[0], (seq[1] if len(seq) > 1 else None)
    if fmt.has_scales and sc is None:
        raise ValueError(f"paged_decode: kv_dtype={fmt.name} needs the {which}_scale plane")
    return data, sc


def _check_plane(name: str, t: torch.Tensor, dtype, hkv: int, extent: int, page: int | None, device) -> None:
    if t.dim() != 4 or t.shape[1] != hkv or t.shape[3] != extent or (page is not None and t.shape[2] != page):
        raise ValueError(f"paged_decode: plane {name} is {list(t.shape)}, expected [pages, {hkv}, "
                         f"{page if page is not None else 'page'}, {extent}]")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"paged_decode: plane {name} is {t.dtype}, the format stores {dtype}")
    if t.stride(3) != 1:
        raise ValueError(f"paged_decode: plane {name} needs a contiguous last dim, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"paged_decode: plane {name} on {t.device}, q on {device}")


def paged_decode(q: torch.Tensor, k_planes, v_planes, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 fmt_name: str, scale: float, *, num_splits: int | None = None,
                 out: torch.Tensor | None = None, backend: str | None = None,
                 num_warps: int = 4, cuda_cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Decode attention of one new query token per sequence over its paged, cached K/V.

    Parameters
    ----------
    q : [B, Hq, D] float (bf16/fp16/fp32), last dim contiguous; not rotated (rotated formats
        rotate it inside the kernel).
    k_planes, v_planes : the layer's planes, ``(data, scale)`` (scale ``None`` or omitted for
        unscaled formats) or the pool's dict (``{"k", "k_scale", ...}``); data
        ``[num_pages, Hkv, page, extent]`` in the format's dtype, scale fp16 ``[num_pages, Hkv, page, D/64]``.
    block_tables : int32 [B, max_pages], page ids per sequence (entries past the sequence are ignored).
    seq_lens : int32 [B], cached tokens per sequence including the new one (0 gives zeros).
    fmt_name : a ``ninfer.kvcache.formats`` name (auto, bf16, int8, rk4v4, rk4v4-e8).
    scale : softmax scale (usually D ** -0.5).
    num_splits : splits per (sequence, KV head); default from the SM count, the kernel's occupancy,
        B, Hkv and ``max_pages`` only (never from ``seq_lens``), so one value serves a captured graph.
    out : optional [B, Hq, D] output buffer (q's dtype).
    backend : ``"triton"``, ``"cuda"`` (the CUDA C++ split kernel, int8/rk4v4/rk4v4-e8, head_dim
        128/256, GQA group <= 8, page 64; raises if it cannot run) or ``"auto"`` (cuda where it can
        run, else triton). Default: ``$NINFER_DECODE_BACKEND`` or ``auto``.
    num_warps, cuda_cfg : tuning knobs for the benchmark (Triton warps; CUDA (warps, chunk, stages)).

    Returns
    -------
    out : [B, Hq, D] in q's dtype, in the natural (unrotated) basis.
    """
    fmt = get_format(fmt_name)
    code = fmt_code(fmt)
    if q.dim() != 3 or not q.is_floating_point() or q.stride(2) != 1:
        raise ValueError(f"paged_decode: q must be a float [B, Hq, D] with contiguous last dim, got "
                         f"{q.dtype}{list(q.shape)} strides {q.stride()}")
    bsz, hq, d = q.shape
    kd, ks = _planes(k_planes, fmt, "k")
    vd, vs = _planes(v_planes, fmt, "v")
    hkv, page = kd.shape[1], kd.shape[2]
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"paged_decode: Hq={hq} is not a multiple of Hkv={hkv}")
    if code != FMT_PLAIN and d % GROUP:
        raise ValueError(f"paged_decode: kv_dtype={fmt.name} needs head_dim % 64 == 0, got {d}")
    if page < 16 or page & (page - 1):
        raise ValueError(f"paged_decode: page size must be a power of 2 >= 16, got {page}")
    data_dt = None if code == FMT_PLAIN else fmt.data_dtype()
    if code == FMT_PLAIN and not kd.is_floating_point():
        raise ValueError(f"paged_decode: kv_dtype={fmt.name} planes must be float, got {kd.dtype}")
    if fmt.storage is not None and code == FMT_PLAIN:
        data_dt = fmt.storage
    ext = fmt.data_extent(d)
    _check_plane("k", kd, data_dt, hkv, ext, page, q.device)
    _check_plane("v", vd, kd.dtype, hkv, ext, page, q.device)
    if vd.shape[0] != kd.shape[0]:
        raise ValueError(f"paged_decode: k/v planes have {kd.shape[0]}/{vd.shape[0]} pages")
    g = d // GROUP
    if fmt.has_scales:
        _check_plane("k_scale", ks, torch.float16, hkv, g, page, q.device)
        _check_plane("v_scale", vs, torch.float16, hkv, g, page, q.device)
    else:
        ks, vs = kd, vd
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or block_tables.dtype != torch.int32:
        raise ValueError(f"paged_decode: block_tables must be int32 [{bsz}, max_pages], got "
                         f"{block_tables.dtype}{list(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("paged_decode: block_tables needs a contiguous last dim")
    if seq_lens.shape != (bsz,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"paged_decode: seq_lens must be int32 [{bsz}], got {seq_lens.dtype}{list(seq_lens.shape)}")
    if block_tables.device != q.device or seq_lens.device != q.device:
        raise ValueError("paged_decode: q, block_tables and seq_lens must be on one device")
    if seq_lens.stride(0) != 1:
        seq_lens = seq_lens.contiguous()
    max_pages = block_tables.shape[1]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"paged_decode: out must be contiguous {q.dtype}{list(q.shape)}")
    if bsz == 0:
        return out
    backend = (backend or os.environ.get("NINFER_DECODE_BACKEND") or "auto").lower()
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"paged_decode: backend must be auto, triton or cuda, got {backend!r}")
    use_cuda = False
    if backend != "triton":
        why = cuda_path_supported(q, kd, fmt.name)
        if why is None and not all(t.is_contiguous() for t in (kd, vd, ks, vs)):
            why = "planes not contiguous"
        if why is None and _CUDA.error is None:
            use_cuda = True
        elif backend == "cuda":
            raise ValueError(f"paged_decode: CUDA path unavailable: {why or _CUDA.error}")
    if use_cuda:
        cfg = cuda_cfg or CUDA_DEFAULT_CFG[code]
        try:
            splits = int(num_splits) if num_splits is not None else cuda_num_splits(
                bsz, hkv, max_pages, q.device, fmt.name, d, q.dtype, cfg)
        except Exception as e:  # compile/load failure: remember it and use the portable path
            if backend == "cuda":
                raise
            _CUDA.error = f"{type(e).__name__}: {e}"
            use_cuda = False
    if not use_cuda:
        splits = int(num_splits) if num_splits is not None else default_num_splits(bsz, hkv, max_pages, q.device)
    if splits < 1:
        raise ValueError(f"paged_decode: num_splits must be >= 1, got {splits}")
    mid_o = torch.empty(bsz * hq, splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bsz * hq, splits, dtype=torch.float32, device=q.device)
    if use_cuda:
        _paged_decode_cuda_split(q, kd, ks, vd, vs, block_tables, seq_lens, mid_o, mid_lse, code, scale,
                                 splits, cfg)
        decode_reduce(mid_o, mid_lse, out.view(bsz * hq, d), rotated=fmt.rotated)
        return out
    # Packed formats also read their bytes as little-endian 32-bit words (one E8 block each).
    if code in (FMT_RK4, FMT_E8):
        kw, vw = kd.view(torch.int32), vd.view(torch.int32)
    else:
        kw, vw = kd, vd
    group = hq // hkv
    block_m = max(16, triton.next_power_of_2(group))
    block_g = triton.next_power_of_2(max(1, g))
    _paged_decode_split_kernel[(bsz, hkv, splits)](
        q, kd, kw, ks, vd, vw, vs, block_tables, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        kd.stride(0), kd.stride(1), kd.stride(2), kw.stride(0), kw.stride(1), kw.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vd.stride(0), vd.stride(1), vd.stride(2), vw.stride(0), vw.stride(1), vw.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        block_tables.stride(0), mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0),
        float(scale) * LOG2E, splits,
        HQ=hq, GROUP_SIZE=group, BLOCK_M=block_m, D=d, BLOCK_D=triton.next_power_of_2(d),
        G=g, BLOCK_G=block_g, FMT=code, PAGE=page, INTERPRET=_interpreting(), num_warps=num_warps)
    decode_reduce(mid_o, mid_lse, out.view(bsz * hq, d), rotated=fmt.rotated)
    return out



# ============================================================================= CUDA C++ path
# The Triton kernel above is the portable path. On NVIDIA GPUs (sm_80+) the packed/int8 formats
# also have a CUDA C++ split kernel: mma.sync m16n8k16 with fragments built straight from the
# stored words (no shared-memory re-layout of a converted tile), per-warp cp.async pipelines and
# PTX bit tricks for the 4-bit -> fp16 conversion. It is compiled at first use with the nvcc found
# on the machine (cubin cached under ~/.cache/ninfer/cuda or $NINFER_CACHE_DIR) and launched
# through the CUDA driver API (ctypes), on torch's current stream (CUDA-graph capturable).
# Layout facts the fragments rely on (docs/KERNELS.md has the derivation):
# * score MMA  S^T = K . Q^T : K is the A operand (16 tokens x 16 dims), Q^T the B operand;
#   thread (gi = lane/4, ti = lane%4) converts words 2ti, 2ti+1 of each group of tokens gi, gi+8;
#   word -> half2 pairs (nibble s, nibble s+4); Q is permuted to the same k order.
# * output MMA O^T = V^T . P^T : V^T is the A operand (16 dims x 16 tokens); thread gi converts
#   word gi of each group of tokens 2ti, 2ti+1, 2ti+8, 2ti+9, pairing two tokens per half2 with
#   one prmt; P^T comes from the score accumulators by two movmatrix transposes.
# * E8: per word, parity fix of nibble 7 (one multiply) and the coset bit c folded into the fp16
#   conversion constants (p = n + c/2 exactly); V and K group scales: K per group accumulator,
#   V folded into P per group.
_CUDA_SRC = r"""
// ninfer paged decode, CUDA path (split kernel). See paged_decode.py for the contract.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace nd {

__device__ __forceinline__ uint32_t lop_and_or(uint32_t a, uint32_t m, uint32_t b) {
  uint32_t r;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(m), "r"(b));  // (a & m) | b
  return r;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm volatile("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ uint32_t hsub2u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm volatile("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t hfma2u(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ uint32_t hmul2u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm volatile("mul.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t movtrans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// E8 word (8 offset-binary nibbles, nibble j in bits [4j, 4j+4), coset bit c in bit 28):
// true low bit of nibble 7 = parity of nibbles 0..6. xor of all 8 stored low bits = par ^ c, so
// flipping bit 28 by that xor puts par there. The multiply sums the eight low bits in the top nibble.
__device__ __forceinline__ uint32_t e8_fix(uint32_t w) {
  uint32_t m = (w & 0x11111111u) * 0x11111111u;
  return w ^ (m & 0x10000000u);
}

// K operand (same token, dims in pairs): word -> 4 half2 (nib s, nib s+4), s = 0..3, as p = n + c/2.
template <bool E8>
__device__ __forceinline__ void k_word(uint32_t w, uint32_t* out) {
  uint32_t lo_sub, hi_base;
  if (E8) {
    uint32_t c = (w >> 28) & 1u;
    w = e8_fix(w);
    lo_sub = 0x48004800u - c * 0x00800080u;  // half2(8 - c/2)
    hi_base = 0x64006400u | (c * 0x00080008u);  // 1024 + 16u + 8c
  } else {
    lo_sub = 0x48004800u;
    hi_base = 0x64006400u;
  }
  const uint32_t k1024 = 0x64006400u;
  const uint32_t k16 = 0x2C002C00u;   // 1/16
  const uint32_t km72 = 0xD480D480u;  // -72
  uint32_t y = w >> 8;
  out[0] = hsub2u(hsub2u(lop_and_or(w, 0x000f000fu, k1024), k1024), lo_sub);
  out[1] = hfma2u(lop_and_or(w, 0x00f000f0u, hi_base), k16, km72);
  out[2] = hsub2u(hsub2u(lop_and_or(y, 0x000f000fu, k1024), k1024), lo_sub);
  out[3] = hfma2u(lop_and_or(y, 0x00f000f0u, hi_base), k16, km72);
}

// V operand (two tokens a, b; same dims): byte q of both words -> (lo nibble pair, hi nibble pair).
__device__ __forceinline__ void v_pair(uint32_t wa, uint32_t wb, int q, uint32_t lo_sub, uint32_t hi_base,
                                       uint32_t& lo, uint32_t& hi) {
  const uint32_t k1024 = 0x64006400u;
  const uint32_t k16 = 0x2C002C00u;
  const uint32_t km72 = 0xD480D480u;
  uint32_t x = prmt(wa, wb, (uint32_t)(q | (q << 4) | ((q + 4) << 8) | ((q + 4) << 12)));
  lo = hsub2u(hsub2u(lop_and_or(x, 0x000f000fu, k1024), k1024), lo_sub);
  hi = hfma2u(lop_and_or(x, 0x00f000f0u, hi_base), k16, km72);
}

// Sign pattern s_i of the format's rotation R = S.H64.S: (-1)^parity((i & (i >> 1)) & 0b010101).
__device__ __forceinline__ float rot_sign(int i) {
  return (__popc((i & (i >> 1)) & 0x15) & 1) ? -1.f : 1.f;
}

template <typename QT>
__device__ __forceinline__ float to_f(QT x);
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// FMT: 1 = int8, 2 = rk4v4, 3 = rk4v4-e8.  One block = NW warps = one (split, kv head, seq).
template <int FMT, int D, int NW, int CHUNK, int NST, typename QT>
__device__ __forceinline__ void decode_split_body(const QT* __restrict__ q, const uint8_t* __restrict__ kd, const __half* __restrict__ ks,
                    const uint8_t* __restrict__ vd, const __half* __restrict__ vs,
                    const int* __restrict__ bt, const int* __restrict__ sl, float* __restrict__ mid_o,
                    float* __restrict__ mid_lse, int64_t sq_b, int64_t sq_h, int64_t d_ps, int64_t d_hs,
                    int64_t s_ps, int64_t s_hs, int64_t bt_s, int hq, int group, int num_splits, float qk_scale) {
  constexpr int G = D / 64;
  constexpr int RB = (FMT == 1) ? D : D / 2;  // data bytes per token
  constexpr int NCH = RB / 16;                // 16-byte chunks per token row
  constexpr int SB = G * 2;                   // scale bytes per token
  constexpr int STAGE = CHUNK * (2 * RB + 2 * SB);
  constexpr int NSUB = CHUNK / 16;
  constexpr bool ROT = FMT != 1;
  constexpr int KSTEPS = D / 16;  // k-steps of the score MMA; also m-tiles of the output MMA

  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float q_s[8][D];
  __shared__ float m_s[NW][8];
  __shared__ float l_s[NW][8];

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid_all = threadIdx.x, warp = tid_all / 32, lane = tid_all % 32;
  const int gi = lane >> 2, ti = lane & 3;
  const int L = sl[b];
  const int n_pages = (L + 63) / 64;
  const int per = (n_pages + num_splits - 1) / num_splits;
  const int p_lo = split * per;
  const int p_hi = min(p_lo + per, n_pages);
  const int t_lo = p_lo * 64;
  const int t_hi = min(p_hi * 64, L);
  const int nchunks = t_hi > t_lo ? (t_hi - t_lo + CHUNK - 1) / CHUNK : 0;

  const int h0 = kvh * group;
  // ---- per-warp pipeline over chunks k = warp, warp + NW, ...
  uint8_t* wbase = smem + warp * NST * STAGE;
  const int my_n = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  const uint8_t* kd_h = kd + kvh * d_hs;
  const uint8_t* vd_h = vd + kvh * d_hs;
  const uint8_t* ks_h = reinterpret_cast<const uint8_t*>(ks) + kvh * s_hs;
  const uint8_t* vs_h = reinterpret_cast<const uint8_t*>(vs) + kvh * s_hs;
  const int* bt_b = bt + b * bt_s;

  auto issue = [&](int it) {
    if (it < my_n) {
      int t0 = t_lo + (warp + it * NW) * CHUNK;
      int64_t page = bt_b[t0 >> 6];
      int off = t0 & 63;
      uint8_t* st = wbase + (it % NST) * STAGE;
      const uint8_t* gk = kd_h + page * d_ps + off * RB;
      const uint8_t* gv = vd_h + page * d_ps + off * RB;
#pragma unroll
      for (int p = lane; p < CHUNK * NCH; p += 32) {
        int tok = p / NCH, ch = p % NCH;
        int dst = tok * RB + ((ch ^ (tok & (NCH - 1))) << 4);
        cp_async16(st + dst, gk + p * 16);
        cp_async16(st + CHUNK * RB + dst, gv + p * 16);
      }
      const uint8_t* gks = ks_h + page * s_ps + off * SB;
      const uint8_t* gvs = vs_h + page * s_ps + off * SB;
#pragma unroll
      for (int p = lane; p < CHUNK * SB / 16; p += 32) {
        cp_async16(st + 2 * CHUNK * RB + p * 16, gks + p * 16);
        cp_async16(st + 2 * CHUNK * RB + CHUNK * SB + p * 16, gvs + p * 16);
      }
    }
    cp_commit();
  };


  // The first stages' loads are in flight while Q is prepared.
#pragma unroll
  for (int i = 0; i < NST - 1; ++i) issue(i);

  // ---- Q: load the group's rows (fp32), rotate by H64 (in-place fast Walsh-Hadamard, /8).
  for (int i = tid_all; i < 8 * D; i += NW * 32) {
    int r = i / D, d = i % D;
    q_s[r][d] = r < group ? to_f<QT>(q[b * sq_b + (h0 + r) * sq_h + d]) * (ROT ? rot_sign(d & 63) : 1.f) : 0.f;
  }
  __syncthreads();
  if (ROT) {
#pragma unroll
    for (int hbit = 1; hbit < 64; hbit <<= 1) {
      for (int i = tid_all; i < 8 * D / 2; i += NW * 32) {
        int r = i / (D / 2), pidx = i % (D / 2);
        int lowp = pidx & (hbit - 1);
        int d0 = ((pidx - lowp) << 1) + lowp;
        float a = q_s[r][d0], c = q_s[r][d0 + hbit];
        q_s[r][d0] = a + c;
        q_s[r][d0 + hbit] = a - c;
      }
      __syncthreads();
    }
  }
  const float qmul = ROT ? 0.125f : 1.f;  // (and the sign pattern again, below): R = S.H64.S
  // B fragments of Q^T for the score MMA: per k-step 2 regs (row n = gi).
  uint32_t qb[KSTEPS][2];
#pragma unroll
  for (int ks_ = 0; ks_ < KSTEPS; ++ks_) {
    int g = ks_ / 4, s = ks_ % 4;
    int d00, d01, d10, d11;
    if (FMT == 1) {  // int8: k=2ti+h -> byte 16ti+4s+h; k=2ti+8+h -> byte 16ti+4s+2+h
      d00 = 64 * g + 16 * ti + 4 * s;
      d01 = d00 + 1;
      d10 = d00 + 2;
      d11 = d00 + 3;
    } else {  // 4-bit: k=2ti+h -> dim 8(s+4h)+2ti; k=2ti+8+h -> dim 8(s+4h)+2ti+1
      d00 = 64 * g + 8 * s + 2 * ti;
      d01 = d00 + 32;
      d10 = d00 + 1;
      d11 = d00 + 33;
    }
    const float m00 = ROT ? qmul * rot_sign(d00 & 63) : qmul, m01 = ROT ? qmul * rot_sign(d01 & 63) : qmul;
    const float m10 = ROT ? qmul * rot_sign(d10 & 63) : qmul, m11 = ROT ? qmul * rot_sign(d11 & 63) : qmul;
    qb[ks_][0] = pack_half2(q_s[gi][d00] * m00, q_s[gi][d01] * m01);
    qb[ks_][1] = pack_half2(q_s[gi][d10] * m10, q_s[gi][d11] * m11);
  }

  float o[KSTEPS][4];
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_r[2] = {-INFINITY, -INFINITY};
  float l_r[2] = {0.f, 0.f};

  for (int it = 0; it < my_n; ++it) {
    cp_wait<NST - 2>();
    __syncwarp();
    issue(it + NST - 1);  // refills the stage consumed in the previous iteration
    const uint8_t* st = wbase + (it % NST) * STAGE;
    const uint8_t* sk = st;
    const uint8_t* sv = st + CHUNK * RB;
    const __half* sks = reinterpret_cast<const __half*>(st + 2 * CHUNK * RB);
    const __half* svs = reinterpret_cast<const __half*>(st + 2 * CHUNK * RB + CHUNK * SB);
    const int t0 = t_lo + (warp + it * NW) * CHUNK;

    // ---- scores S^T [tokens x q rows] for the chunk
    float sc[NSUB][4];
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      const int ta = sub * 16 + gi, tb = ta + 8;
      float tot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (FMT == 1) {
          const int ch = 4 * g + ti;
          uint4 wa = *reinterpret_cast<const uint4*>(sk + ta * RB + ((ch ^ (ta & (NCH - 1))) << 4));
          uint4 wb = *reinterpret_cast<const uint4*>(sk + tb * RB + ((ch ^ (tb & (NCH - 1))) << 4));
          uint32_t wA[4] = {wa.x, wa.y, wa.z, wa.w}, wB[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint32_t xa = wA[s] ^ 0x80808080u, xb = wB[s] ^ 0x80808080u;
            const uint32_t k1152 = 0x64806480u;
            uint32_t a0 = hsub2u(prmt(xa, 0x64646464u, 0x4140u), k1152);
            uint32_t a2 = hsub2u(prmt(xa, 0x64646464u, 0x4342u), k1152);
            uint32_t a1 = hsub2u(prmt(xb, 0x64646464u, 0x4140u), k1152);
            uint32_t a3 = hsub2u(prmt(xb, 0x64646464u, 0x4342u), k1152);
            mma16816(acc, a0, a1, a2, a3, qb[g * 4 + s][0], qb[g * 4 + s][1]);
          }
        } else {
          const int byte = g * 32 + ti * 8;
          const int ch = byte >> 4, inner = byte & 15;
          uint2 wa = *reinterpret_cast<const uint2*>(sk + ta * RB + ((ch ^ (ta & (NCH - 1))) << 4) + inner);
          uint2 wb = *reinterpret_cast<const uint2*>(sk + tb * RB + ((ch ^ (tb & (NCH - 1))) << 4) + inner);
          uint32_t ra0[4], ra1[4], rb0[4], rb1[4];
          k_word<FMT == 3>(wa.x, ra0);
          k_word<FMT == 3>(wa.y, ra1);
          k_word<FMT == 3>(wb.x, rb0);
          k_word<FMT == 3>(wb.y, rb1);
#pragma unroll
          for (int s = 0; s < 4; ++s)
            mma16816(acc, ra0[s], rb0[s], ra1[s], rb1[s], qb[g * 4 + s][0], qb[g * 4 + s][1]);
        }
        float sa = __half2float(sks[ta * G + g]), sb = __half2float(sks[tb * G + g]);
        tot[0] += sa * acc[0];
        tot[1] += sa * acc[1];
        tot[2] += sb * acc[2];
        tot[3] += sb * acc[3];
      }
      const bool va = t0 + ta < t_hi, vb = t0 + tb < t_hi;
      sc[sub][0] = va ? tot[0] * qk_scale : -INFINITY;
      sc[sub][1] = va ? tot[1] * qk_scale : -INFINITY;
      sc[sub][2] = vb ? tot[2] * qk_scale : -INFINITY;
      sc[sub][3] = vb ? tot[3] * qk_scale : -INFINITY;
    }
    // ---- online softmax (rows 2ti, 2ti+1 live in this thread; tokens across gi lanes)
    float cm[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      cm[0] = fmaxf(cm[0], fmaxf(sc[sub][0], sc[sub][2]));
      cm[1] = fmaxf(cm[1], fmaxf(sc[sub][1], sc[sub][3]));
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      cm[0] = fmaxf(cm[0], __shfl_xor_sync(0xffffffffu, cm[0], off));
      cm[1] = fmaxf(cm[1], __shfl_xor_sync(0xffffffffu, cm[1], off));
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mn = fmaxf(m_r[r], cm[r]);
      alpha[r] = exp2f(m_r[r] - mn);  // m_r = -inf first: 0
      m_r[r] = mn;
      l_r[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) {
      o[i][0] *= alpha[0];
      o[i][1] *= alpha[1];
      o[i][2] *= alpha[0];
      o[i][3] *= alpha[1];
    }
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      float p0 = exp2f(sc[sub][0] - m_r[0]), p1 = exp2f(sc[sub][1] - m_r[1]);
      float p2 = exp2f(sc[sub][2] - m_r[0]), p3 = exp2f(sc[sub][3] - m_r[1]);
      l_r[0] += p0 + p2;
      l_r[1] += p1 + p3;
      // P^T (tokens x rows) in C layout -> B fragments (tokens as k) by 8x8 transposes.
      uint32_t pb0 = movtrans(pack_half2(p0, p1));  // tokens 0..7 of the sub-chunk
      uint32_t pb1 = movtrans(pack_half2(p2, p3));  // tokens 8..15
      const int tk0 = sub * 16 + 2 * ti;           // this thread's B tokens: tk0, tk0+1, tk0+8, tk0+9
      const bool v0 = t0 + tk0 < t_hi, v1 = t0 + tk0 + 1 < t_hi, v8 = t0 + tk0 + 8 < t_hi,
                 v9 = t0 + tk0 + 9 < t_hi;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        // V scale folded into P per group; garbage scales of unwritten slots are zeroed.
        __half z = __float2half(0.f);
        __half s0 = v0 ? svs[tk0 * G + g] : z, s1 = v1 ? svs[(tk0 + 1) * G + g] : z;
        __half s8 = v8 ? svs[(tk0 + 8) * G + g] : z, s9 = v9 ? svs[(tk0 + 9) * G + g] : z;
        __half2 sA = __halves2half2(s0, s1), sB = __halves2half2(s8, s9);
        uint32_t b0 = hmul2u(pb0, *reinterpret_cast<uint32_t*>(&sA));
        uint32_t b1 = hmul2u(pb1, *reinterpret_cast<uint32_t*>(&sB));
        if (FMT == 1) {
          // thread row gi holds bytes 8gi..8gi+7 of group g; m-tile q: rows gi -> byte 8gi+2q, gi+8 -> +1
          const int byte = g * 64 + gi * 8;
          const int ch = byte >> 4, inner = byte & 15;
          uint2 w[4];
          const int toks[4] = {tk0, tk0 + 1, tk0 + 8, tk0 + 9};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            int t = toks[k];
            w[k] = *reinterpret_cast<const uint2*>(sv + t * RB + ((ch ^ (t & (NCH - 1))) << 4) + inner);
            w[k].x ^= 0x80808080u;
            w[k].y ^= 0x80808080u;
          }
          const uint32_t k1152 = 0x64806480u, k64 = 0x64006400u;
#pragma unroll
          for (int qq = 0; qq < 4; ++qq) {
            // byte 2qq (rows gi) and 2qq+1 (rows gi+8) of the 8 bytes: word qq/2, bytes (qq%2)*2, +1
            const int bsel = (qq & 1) * 2;
            uint32_t xa01 = prmt(qq < 2 ? w[0].x : w[0].y, qq < 2 ? w[1].x : w[1].y,
                                 (uint32_t)(bsel | ((bsel + 1) << 4) | ((bsel + 4) << 8) | ((bsel + 5) << 12)));
            uint32_t xa89 = prmt(qq < 2 ? w[2].x : w[2].y, qq < 2 ? w[3].x : w[3].y,
                                 (uint32_t)(bsel | ((bsel + 1) << 4) | ((bsel + 4) << 8) | ((bsel + 5) << 12)));
            // xa01 bytes: [t0.b, t0.b+1, t1.b, t1.b+1]
            uint32_t a0 = hsub2u(lop_and_or(xa01, 0x00ff00ffu, k64), k1152);         // byte b, tokens 0/1
            uint32_t a1 = hsub2u(lop_and_or(xa01 >> 8, 0x00ff00ffu, k64), k1152);    // byte b+1
            uint32_t a2 = hsub2u(lop_and_or(xa89, 0x00ff00ffu, k64), k1152);
            uint32_t a3 = hsub2u(lop_and_or(xa89 >> 8, 0x00ff00ffu, k64), k1152);
            mma16816(o[g * 4 + qq], a0, a1, a2, a3, b0, b1);
          }
        } else {
          const int byte = g * 32 + gi * 4;
          const int ch = byte >> 4, inner = byte & 15;
          uint32_t w[4];
          const int toks[4] = {tk0, tk0 + 1, tk0 + 8, tk0 + 9};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            int t = toks[k];
            w[k] = *reinterpret_cast<const uint32_t*>(sv + t * RB + ((ch ^ (t & (NCH - 1))) << 4) + inner);
          }
          uint32_t lo01 = 0x48004800u, hi01 = 0x64006400u, lo89 = 0x48004800u, hi89 = 0x64006400u;
          if (FMT == 3) {
            uint32_t c0 = (w[0] >> 28) & 1u, c1 = (w[1] >> 28) & 1u, c8 = (w[2] >> 28) & 1u, c9 = (w[3] >> 28) & 1u;
#pragma unroll
            for (int k = 0; k < 4; ++k) w[k] = e8_fix(w[k]);
            lo01 -= c0 * 0x80u + c1 * 0x00800000u;
            hi01 |= (c0 << 3) | (c1 << 19);
            lo89 -= c8 * 0x80u + c9 * 0x00800000u;
            hi89 |= (c8 << 3) | (c9 << 19);
          }
#pragma unroll
          for (int qq = 0; qq < 4; ++qq) {
            uint32_t a0, a1, a2, a3;
            v_pair(w[0], w[1], qq, lo01, hi01, a0, a1);
            v_pair(w[2], w[3], qq, lo89, hi89, a2, a3);
            mma16816(o[g * 4 + qq], a0, a1, a2, a3, b0, b1);
          }
        }
      }
    }
    __syncwarp();
  }
  cp_wait<0>();

  // ---- merge the warps of the block, write this split's partial (H64 domain for rotated formats)
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l_r[0] += __shfl_xor_sync(0xffffffffu, l_r[0], off);
    l_r[1] += __shfl_xor_sync(0xffffffffu, l_r[1], off);
  }
  __syncthreads();  // every warp is done with its stages: reuse smem for the partial outputs
  float* o_s = reinterpret_cast<float*>(smem);  // [NW][8][D]
  if (gi == 0) {
    m_s[warp][2 * ti] = m_r[0];
    m_s[warp][2 * ti + 1] = m_r[1];
    l_s[warp][2 * ti] = l_r[0];
    l_s[warp][2 * ti + 1] = l_r[1];
  }
#pragma unroll
  for (int mt = 0; mt < KSTEPS; ++mt) {
    int d0, d1;
    if (FMT == 1) {
      int g = mt / 4, qq = mt % 4;
      d0 = 64 * g + 8 * gi + 2 * qq;
      d1 = d0 + 1;
    } else {
      d0 = 16 * mt + gi;
      d1 = d0 + 8;
    }
    float* base = o_s + warp * 8 * D;
    base[(2 * ti) * D + d0] = o[mt][0];
    base[(2 * ti + 1) * D + d0] = o[mt][1];
    base[(2 * ti) * D + d1] = o[mt][2];
    base[(2 * ti + 1) * D + d1] = o[mt][3];
  }
  __syncthreads();
  for (int i = tid_all; i < group * D; i += NW * 32) {
    int r = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, m_s[w][r]);
    float num = 0.f, den = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        float f = exp2f(m_s[w][r] - mx);
        num += f * o_s[w * 8 * D + r * D + d];
        den += f * l_s[w][r];
      }
    }
    int64_t row = (int64_t)b * hq + h0 + r;
    mid_o[(row * num_splits + split) * D + d] = den > 0.f ? num / den : 0.f;
    if (d == 0) mid_lse[row * num_splits + split] = den > 0.f ? mx + log2f(den) : -INFINITY;
  }
}

}  // namespace nd

#ifdef ND_FMT
extern "C" __global__ void __launch_bounds__(ND_NW * 32)
nd_decode(const ND_QT* __restrict__ q, const uint8_t* __restrict__ kd, const __half* __restrict__ ks,
          const uint8_t* __restrict__ vd, const __half* __restrict__ vs, const int* __restrict__ bt,
          const int* __restrict__ sl, float* __restrict__ mid_o, float* __restrict__ mid_lse, int64_t sq_b,
          int64_t sq_h, int64_t d_ps, int64_t d_hs, int64_t s_ps, int64_t s_hs, int64_t bt_s, int hq, int group,
          int num_splits, float qk_scale) {
  nd::decode_split_body<ND_FMT, ND_D, ND_NW, ND_CHUNK, ND_NST, ND_QT>(
      q, kd, ks, vd, vs, bt, sl, mid_o, mid_lse, sq_b, sq_h, d_ps, d_hs, s_ps, s_hs, bt_s, hq, group, num_splits,
      qk_scale);
}
#endif

"""

_CUDA_FMT = {FMT_INT8: 1, FMT_RK4: 2, FMT_E8: 3}
# (NW warps, CHUNK tokens per pipeline stage, NST stages) per format kind
CUDA_DEFAULT_CFG = {FMT_INT8: (8, 16, 3), FMT_RK4: (8, 32, 2), FMT_E8: (8, 32, 2)}


class _CudaDecode:
    """nvcc -> cubin -> cuModuleLoadData -> cuLaunchKernel, one module per configuration."""

    def __init__(self) -> None:
        self._drv = None
        self._funcs: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self.error: str | None = None

    # -------------------------------------------------------------- driver
    def _driver(self):
        if self._drv is None:
            drv = ctypes.CDLL("libcuda.so.1")
            drv.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            drv.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
            drv.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
            drv.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            drv.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
            drv.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
                ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            drv.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
                ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            self._drv = drv
        return self._drv

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self._driver().cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"paged_decode CUDA path: {what} failed: {rc} {msg.value!r}")

    # -------------------------------------------------------------- build
    @staticmethod
    def _cache_dir() -> Path:
        d = Path(os.environ.get("NINFER_CACHE_DIR", Path.home() / ".cache" / "ninfer")) / "cuda"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def build(self, key: tuple, arch: str) -> Path:
        fmt_c, d, qt, nw, chunk, nst = key
        defs = {"ND_FMT": fmt_c, "ND_D": d, "ND_NW": nw, "ND_CHUNK": chunk, "ND_NST": nst,
                "ND_QT": "__nv_bfloat16" if qt == "bf16" else "__half"}
        tag = hashlib.sha1((_CUDA_SRC + repr(sorted(defs.items())) + arch).encode()).hexdigest()[:16]
        out = self._cache_dir() / f"nd_decode_{tag}.cubin"
        if out.exists():
            return out
        nvcc = _nvcc()
        if nvcc is None:
            raise RuntimeError("paged_decode CUDA path: nvcc not found")
        with tempfile.TemporaryDirectory() as tmp:
            cu = Path(tmp) / "nd_decode.cu"
            cu.write_text(_CUDA_SRC)
            tmp_out = Path(tmp) / "out.cubin"
            cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", "-o", str(tmp_out), str(cu)]
            cmd += [f"-D{k}={v}" for k, v in defs.items()]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"paged_decode CUDA path: nvcc failed:\n{res.stderr[-3000:]}")
            shutil.move(str(tmp_out), out)
        return out

    def function(self, key: tuple, device: torch.device):
        with self._lock:
            fkey = (key, device.index)
            if fkey in self._funcs:
                return self._funcs[fkey]
            major, minor = torch.cuda.get_device_capability(device)
            path = self.build(key, f"sm_{major}{minor}")
            torch.cuda.init()
            with torch.cuda.device(device):
                torch.cuda.current_stream(device).synchronize()  # makes torch's context current
                drv = self._driver()
                mod = ctypes.c_void_p()
                self._check(drv.cuModuleLoadData(ctypes.byref(mod), path.read_bytes()), "cuModuleLoadData")
                fn = ctypes.c_void_p()
                self._check(drv.cuModuleGetFunction(ctypes.byref(fn), mod, b"nd_decode"), "cuModuleGetFunction")
                smem = _cuda_smem_bytes(key)
                self._check(drv.cuFuncSetAttribute(fn, 8, smem), "cuFuncSetAttribute(max dynamic smem)")
                nw = key[3]
                occ = ctypes.c_int()
                self._check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(occ), fn, nw * 32, smem),
                            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
                regs = ctypes.c_int()
                drv.cuFuncGetAttribute(ctypes.byref(regs), 4, fn)  # CU_FUNC_ATTRIBUTE_NUM_REGS
            entry = (mod, fn, smem, max(1, occ.value), regs.value)
            self._funcs[fkey] = entry
            return entry

    def launch(self, fn, grid, block: int, smem: int, stream: int, args: list) -> None:
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            elif isinstance(a, tuple):  # ("i64", v)
                holders.append(ctypes.c_int64(a[1]))
            else:
                holders.append(ctypes.c_int(a))
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        rc = self._driver().cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, smem,
                                           ctypes.c_void_p(stream), params, None)
        self._check(rc, "cuLaunchKernel")


_CUDA = _CudaDecode()


def _cuda_smem_bytes(key: tuple) -> int:
    fmt_c, d, _qt, nw, chunk, nst = key
    g = d // GROUP
    rb = d if fmt_c == 1 else d // 2
    stage = chunk * (2 * rb + 4 * g)
    return max(nw * nst * stage, nw * 8 * d * 4)


def cuda_path_supported(q: torch.Tensor, kd: torch.Tensor, fmt_name: str) -> str | None:
    """None if the CUDA path can run this call, else the reason it cannot."""
    fmt = get_format(fmt_name)
    code = fmt_code(fmt)
    if code not in _CUDA_FMT:
        return f"format {fmt.name} has no CUDA path"
    if q.device.type != "cuda":
        return "not on CUDA"
    if _capability(q.device) < (8, 0):
        return "needs sm_80+"
    bsz, hq, d = q.shape
    if d not in (128, 256):
        return f"head_dim {d} (CUDA path: 128 or 256)"
    if hq // kd.shape[1] > 8:
        return f"GQA group {hq // kd.shape[1]} > 8"
    if kd.shape[2] != 64:
        return "page size != 64"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q.dtype}"
    if _nvcc() is None:
        return "nvcc not found"
    return None


@functools.lru_cache(maxsize=None)
def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        found = "/usr/local/cuda/bin/nvcc"
    return found


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _paged_decode_cuda_split(q, kd, ks, vd, vs, block_tables, seq_lens, mid_o, mid_lse, code, scale,
                             splits, cfg) -> None:
    bsz, hq, d = q.shape
    hkv = kd.shape[1]
    for t, nm in ((kd, "k"), (vd, "v"), (ks, "k_scale"), (vs, "v_scale")):
        if not t.is_contiguous():
            raise ValueError(f"paged_decode(cuda): plane {nm} must be contiguous")
    nw, chunk, nst = cfg
    key = (_CUDA_FMT[code], d, "bf16" if q.dtype == torch.bfloat16 else "fp16", nw, chunk, nst)
    _mod, fn, smem, _occ, _regs = _CUDA.function(key, q.device)
    esz = kd.element_size()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _CUDA.launch(fn, (splits, hkv, bsz), nw * 32, smem, stream, [
        q, kd, ks, vd, vs, block_tables, seq_lens, mid_o, mid_lse,
        ("i64", q.stride(0)), ("i64", q.stride(1)),
        ("i64", kd.stride(0) * esz), ("i64", kd.stride(1) * esz),
        ("i64", ks.stride(0) * 2), ("i64", ks.stride(1) * 2), ("i64", block_tables.stride(0)),
        hq, hq // hkv, splits, float(scale) * LOG2E])


def cuda_num_splits(batch: int, num_kv_heads: int, max_pages: int, device: torch.device, fmt_name: str,
                    head_dim: int, q_dtype=torch.bfloat16, cfg=None) -> int:
    """Splits for the CUDA path: one wave of resident blocks (occupancy x SMs), from fixed sizes only."""
    code = fmt_code(get_format(fmt_name))
    cfg = cfg or CUDA_DEFAULT_CFG[code]
    key = (_CUDA_FMT[code], head_dim, "bf16" if q_dtype == torch.bfloat16 else "fp16", *cfg)
    _mod, _fn, _smem, occ, _regs = _CUDA.function(key, device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    s = (occ * _SM_COUNT[idx]) // max(1, batch * num_kv_heads)
    return int(max(1, min(s, max_pages, 512)))


def cuda_kernel_info(fmt_name: str, head_dim: int, device: torch.device, q_dtype=torch.bfloat16, cfg=None) -> dict:
    """Registers, shared memory and occupancy of the CUDA split kernel (for the benchmark report)."""
    code = fmt_code(get_format(fmt_name))
    cfg = cfg or CUDA_DEFAULT_CFG[code]
    key = (_CUDA_FMT[code], head_dim, "bf16" if q_dtype == torch.bfloat16 else "fp16", *cfg)
    _mod, _fn, smem, occ, regs = _CUDA.function(key, device)
    return {"regs": regs, "dyn_smem": smem, "blocks_per_sm": occ, "warps": cfg[0], "chunk": cfg[1], "stages": cfg[2]}


# ----------------------------------------------------------------------------- torch reference
def paged_decode_ref(q: torch.Tensor, k_planes, v_planes, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     fmt_name: str, scale: float) -> torch.Tensor:
    """Oracle for :func:`paged_decode`: gathers each sequence's pages, decodes them with the format
    registry's reference decode (natural basis) and attends in float64, on the inputs' device.
    Returns float32 [B, Hq, D] (zeros for an empty sequence)."""
    fmt = get_format(fmt_name)
    kd, ks = _planes(k_planes, fmt, "k")
    vd, vs = _planes(v_planes, fmt, "v")
    bsz, hq, d = q.shape
    hkv, page = kd.shape[1], kd.shape[2]
    grp = hq // hkv
    dev = kd.device
    out = torch.zeros(bsz, hq, d, dtype=torch.float64, device=dev)
    lens = seq_lens.cpu().tolist()
    bt = block_tables.cpu()
    for b in range(bsz):
        n = int(lens[b])
        if n == 0:
            continue
        pages = bt[b, : math.ceil(n / page)].long().to(dev)

        def gather(t):
            x = t[pages]  # [n_pages, Hkv, page, ext]
            return x.permute(1, 0, 2, 3).reshape(hkv, -1, x.shape[-1])[:, :n]

        if fmt.has_scales:
            k = fmt.decode(gather(kd), gather(ks), rotated=False, dtype=torch.float64)
            v = fmt.decode(gather(vd), gather(vs), rotated=False, dtype=torch.float64)
        else:
            k, v = gather(kd).to(torch.float64), gather(vd).to(torch.float64)
        qb = q[b].detach().to(device=dev, dtype=torch.float64).reshape(hkv, grp, d)
        s = torch.einsum("hgd,hnd->hgn", qb, k) * float(scale)
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hgn,hnd->hgd", p, v).reshape(hq, d)
    return out.to(torch.float32)


__all__: Sequence[str] = ("paged_decode", "paged_decode_ref", "default_num_splits", "cuda_num_splits",
                          "cuda_path_supported", "cuda_kernel_info", "fmt_code")
