"""The Triton split kernel of paged decode: one program per (sequence, KV head, split) writes its
split's partial output and log-sum-exp; ``paged_decode.py`` documents the algorithm per format,
checks the arguments, launches this kernel and merges the splits (``decode_reduce``)."""
import triton
import triton.language as tl

from ninfer.kernels.hadamard import rot_entry


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _e8_features(w, fcol, half_off):
    """Per-word E8 features; w uint32 [..., 16] where column f holds word f % 8.
    Column f < 8: par - c (true n7 minus stored n7); column f >= 8: c / 2 - half_off."""
    c = (w >> 28) & 1
    # xor of the 8 stored nibble low bits (bits 0, 4, ..., 28) = par ^ c: the multiply sums the
    # eight bits into the top nibble (each column sum <= 8 < 16, no carries between nibbles).
    t = ((w & 0x11111111) * 0x11111111) >> 28
    par = (t ^ c) & 1
    f1 = par.to(tl.float32) - c.to(tl.float32)
    return tl.where(fcol < 8, f1, c.to(tl.float32) * 0.5 - half_off)


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
        h_lo = rot_entry(oj[None, :], dim_lo[:, None])          # [32, 64]: row c = H64 column dim_lo(c)
        h_hi = rot_entry(oj[None, :], dim_lo[:, None] + 8)
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
                h_f += tl.where((of[:, None] >= 8) | (jj == 7), rot_entry(oj[None, :], 8 * jj + wf), 0.0)
            qf = tl.dot(tl.broadcast_to(h_f[None, :, :], [BLOCK_G, 16, 64]), q3,
                        input_precision="ieee").to(tl.float16)  # [G, 16, M]
            accf = tl.zeros([BLOCK_G, BLOCK_M, 16], tl.float32)
            goff_kw = og[:, None, None] * 8 + offs_t[None, :, None] * skw_t + (of % 8)[None, None, :]
            goff_vw = og[:, None, None] * 8 + offs_t[None, :, None] * svw_t + (of % 8)[None, None, :]
        acc_lo = tl.zeros([BLOCK_G, BLOCK_M, 32], tl.float32)
        acc_hi = tl.zeros([BLOCK_G, BLOCK_M, 32], tl.float32)
        v_off = 8.0
        if FMT == 3:
            v_off = 7.75
        goff_k = og[:, None, None] * 32 + offs_t[None, :, None] * sk_t + oc[None, None, :]
        goff_v = og[:, None, None] * 32 + offs_t[None, :, None] * sv_t + oc[None, None, :]
        for i in range(p_lo, p_hi):
            page = tl.load(BT + b * sbt_b + i).to(tl.int64)
            kb = tl.load(KD + page * sk_p + kvh * sk_h + goff_k, mask=gmask[:, None, None], other=0)
            s3 = tl.dot((kb & 15).to(tl.float16), qlo) + tl.dot((kb >> 4).to(tl.float16), qhi)  # [G, T, M]
            if FMT == 3:
                kw = tl.load(KW + page * skw_p + kvh * skw_h + goff_kw, mask=gmask[:, None, None], other=0)
                kf = _e8_features(kw.to(tl.uint32, bitcast=True), fcol, 0.0).to(tl.float16)
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
            # V operands centred (exact in fp16): u - 8 (rk4v4), u - 7.75 with c/2 - 1/4 as the
            # coset feature (rk4v4-e8). The accumulators live for the whole split, and the tensor
            # cores' fp32 accumulation error grows with any constant they carry: with the +8 left in
            # (removed at the end), one 262K-token split had rel. error ~1 on the H200; 1.7e-3 now
            acc_lo = acc_lo * alpha[None, :, None] + tl.dot(p3, ((vb & 15).to(tl.float16) - v_off).to(tl.float16))
            acc_hi = acc_hi * alpha[None, :, None] + tl.dot(p3, ((vb >> 4).to(tl.float16) - v_off).to(tl.float16))
            if FMT == 3:
                vw = tl.load(VW + page * svw_p + kvh * svw_h + goff_vw, mask=gmask[:, None, None], other=0)
                vf = _e8_features(vw.to(tl.uint32, bitcast=True), fcol, 0.25).to(tl.float16)
                accf = accf * alpha[None, :, None] + tl.dot(p3, vf)
            m_i = m_new
        lo = acc_lo
        hi = acc_hi
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
