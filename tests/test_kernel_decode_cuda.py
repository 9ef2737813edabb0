"""The CUDA C++ paged-decode path (ninfer/kernels/paged_decode_cuda.py, csrc/paged_decode.cu): the
operand algebra emulated in numpy against the codec on CPU, the kernel compiled for sm_90 by nvcc and
NVRTC, its stage layout and shared-memory budget; on a GPU, the kernel against the float64 oracle."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------- CUDA path arithmetic
# The CUDA split kernel (``_CUDA_SRC`` in paged_decode.py) feeds stored 4-bit words to the tensor cores
# as they are: K's nibbles as u8 against Q rounded to int8 per 64-group (int8 MMAs), V's as raw fp16
# operands (1024 + u, 1024 + 16 u, bias subtracted), and moves the -8 offset, the E8 coset bit and the
# nibble-7 parity fix out of the element path: accumulator constants, one fp16 feature k-step for K,
# one feature tile and a per-element correction at the end for V, the features' bits counted by binary
# MMAs. None of that can run here, so these tests emulate exactly those operations in numpy (masks,
# prmt, popcounts, int8 rounding, fp16 rounding of the MMA operands) for one 64-group and compare
# with the codec's reference decode in float64. The GPU tests check the kernel.
def _h2(u32):
    import numpy as np
    return np.array([u32 & 0xFFFF, u32 >> 16], dtype=np.uint16).view(np.float16)


def _u32(h):
    import numpy as np
    a = np.asarray(h, dtype=np.float16).view(np.uint16).astype(np.uint32)
    return int(a[0] | (a[1] << 16))


def _hsub2(a, b):
    return _u32(_h2(a) - _h2(b))


def _lop(a, m, b):
    return ((a & m) | b) & 0xFFFFFFFF


def _prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _popc(x):
    return bin(x & 0xFFFFFFFF).count("1")


def _bits2(lo, hi, base):
    """A feature half2 from two bit counts (bmma_popc): bit 0 of each at bits 12 / 28, as the kernel's
    lop_and_or(hi * 0x10000000 + lo * 0x1000, 0x10001000, base)."""
    return _lop(((hi * 0x10000000) + (lo * 0x1000)) & 0xFFFFFFFF, 0x10001000, base)


def _q_int8(qv):
    """Q as the 4-bit score MMAs see it: q8 = rint(q * 127 / max|q|), scale max|q| / 127 (float32 math)."""
    import numpy as np
    q = qv.astype(np.float32)
    amax = np.float32(np.abs(q).max())
    qinv = np.float32(127.0) / amax if amax > 0 else np.float32(0)
    q8 = np.rint(q * qinv).astype(np.int64)
    assert np.abs(q8).max() <= 127
    return q8, float(amax * np.float32(1.0 / 127.0))


def _k_score(words, qv, e8_fmt, exact_weights=False):
    """One token's score over one 64-group as the kernel forms it: int8 MMAs on the nibbles (bytes j of
    w & 0x0F0F0F0F = nibbles 2j, of (w >> 4) & 0x0F0F0F0F = nibbles 2j + 1) against q8, the E8 feature
    k-step against fp16 weights of qe = qsc q8, and the accumulators' start values."""
    import numpy as np
    q8, qsc = _q_int8(qv)
    qe = qsc * q8.astype(np.float64)
    acc_i = 0
    for w, word in enumerate(words):
        lo, hi = int(word) & 0x0F0F0F0F, (int(word) >> 4) & 0x0F0F0F0F
        for j in range(4):  # byte j of the two A registers: dims 16 j + w and 16 j + 8 + w
            acc_i += ((lo >> (8 * j)) & 0xFF) * int(q8[16 * j + w]) + ((hi >> (8 * j)) & 0xFF) * int(q8[16 * j + 8 + w])
    total = qsc * (acc_i - 8 * int(q8.sum()))
    wc, wp = np.zeros(8), np.zeros(8)
    wabs = 0.0
    for w in range(8):
        qs, q7 = qe[[8 * j + w for j in range(8)]].sum(), qe[56 + w]
        if e8_fmt:
            wc[w], wp[w] = (0.5 * qs - q7) * 16 / 15, q7 * 16 / 15
            if not exact_weights:
                wc[w], wp[w] = float(np.float16(wc[w])), float(np.float16(wp[w]))
        total -= 0.0625 * (wc[w] + wp[w])
        wabs += abs(0.5 * qs - q7) + abs(q7)
    if e8_fmt:  # k = 2ti + h: c of word 2ti + h; k = 2ti + 8 + h: its parity (bit counts, bmma_popc)
        for w in range(0, 8, 2):
            a, b = int(words[w]), int(words[w + 1])
            fc = _h2((_popc(b & 0x10000000) * 0x10000000 + _popc(a & 0x10000000) * 0x1000 + 0x2C002C00) & 0xFFFFFFFF)
            fp = _h2(_bits2(_popc(a & 0x01111111), _popc(b & 0x01111111), 0x2C002C00))
            total += fc.astype(np.float64) @ wc[w:w + 2] + fp.astype(np.float64) @ wp[w:w + 2]
    return total, qe, wabs


def _v_block(words, p, e8_fmt):
    """O of the 8 dims of one word over 16 tokens as the kernel forms it: data MMAs on sc (u - 8)
    operands, the feature tile (c, par), the end correction; words[t] = the word of token t and
    p = the fp16 weights (P^T with the V scale folded in)."""
    import numpy as np
    o = np.zeros(8)  # [2qq] = dim 16qq + gi (low nibble), [2qq+1] = dim 16qq + 8 + gi (high)
    f_c = f_p = 0.0
    for k in range(0, 16, 2):
        wa, wb, pk = int(words[k]), int(words[k + 1]), p[k:k + 2].astype(np.float64)
        for qq in range(4):
            x = _prmt(wa, wb, qq | (qq << 4) | ((qq + 4) << 8) | ((qq + 4) << 12))
            o[2 * qq] += _h2(_hsub2(_lop(x, 0x000F000F, 0x64006400), 0x64086408)).astype(np.float64) @ pk
            o[2 * qq + 1] += _h2(_hsub2(_lop(x, 0x00F000F0, 0x64006400), 0x64806480)).astype(np.float64) @ pk
            if e8_fmt and qq == 3:  # c: bits 12 / 28 of byte 3's pair; par: bit counts
                f_c += _h2(x & 0x10001000).astype(np.float64) @ pk
                f_p += _h2(_bits2(_popc(wa & 0x01111111), _popc(wb & 0x01111111), 0)).astype(np.float64) @ pk
    fc, f7 = f_c * 2048, f_p * 2048 - f_c * 2048
    for qq in range(4):
        o[2 * qq + 1] *= 0.0625
        if e8_fmt:
            o[2 * qq] += 0.5 * fc
            o[2 * qq + 1] += 0.5 * fc + (f7 if qq == 3 else 0.0)
    return o


def test_cuda_raw_operand_algebra_matches_codec():
    import numpy as np
    import torch

    from ninfer.kernels.paged_decode import _CUDA_SRC
    from ninfer.kvcache import e8

    for const in ("0x0F0F0F0Fu", "(wa.x >> 4) & m4", "127.f / amax", "8.f * qsc", "0x01111111u", "0x10000000u",
                  "0x10001000u", "0x2C002C00u", "0x64086408u", "0x64806480u", "16.f / 15.f", "2048.f", "0.0625f",
                  "0x00f000f0u, 0x64006400u", "0x000f000fu, 0x64006400u"):
        assert const in _CUDA_SRC, f"CUDA source no longer uses {const}: update this emulation"
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        z = torch.randn(48, 64, generator=gen) * 3
        z[0], z[1] = 0.0, 100.0  # box corners
        rng = np.random.default_rng(seed)
        for e8_fmt in (True, False):
            data = e8.encode_e8(z) if e8_fmt else e8.encode_scalar4(z)
            ref = (e8.decode_e8(data) if e8_fmt else e8.decode_scalar4(data)).double().numpy()
            words = data.numpy().view(np.uint32)  # [48, 8]: word w holds dims 8j + w
            # K: every token against a few random q rows (rotated-domain values, as the kernel scales them)
            for t in range(48):
                for _ in range(2):
                    qv = (rng.standard_normal(64) * rng.uniform(0.05, 20)).astype(np.float32)
                    exact, qe, _ = _k_score(words[t], qv, e8_fmt, exact_weights=True)
                    want = float(qe @ ref[t])  # the rounded Q, exactly
                    assert abs(exact - want) <= 1e-9 * (np.abs(qe).sum() * 16 + 1), (e8_fmt, t, exact, want)
                    got, qe, wabs = _k_score(words[t], qv, e8_fmt)
                    assert abs(got - want) <= 2.0 ** -11 * wabs * 1.01 + 1e-9 * np.abs(qe).sum() * 16
                    # the rounding itself: each q moves at most half a step, max|q| / 254
                    assert abs(want - float(qv.astype(np.float64) @ ref[t])) <= \
                        np.abs(qv).max() / 254 * np.abs(ref[t]).sum() * 1.0001
            # V: 16 tokens per tile, every word (lane row gi); one weight is a masked slot (0)
            for t0 in range(0, 48, 16):
                p = (rng.uniform(0, 1, 16) * rng.uniform(0.01, 256)).astype(np.float16)
                p[rng.integers(0, 16)] = 0
                for gi in range(8):
                    got = _v_block(words[t0:t0 + 16, gi], p, e8_fmt)
                    dims = [d for qq in range(4) for d in (16 * qq + gi, 16 * qq + 8 + gi)]
                    want = p.astype(np.float64) @ ref[t0:t0 + 16][:, dims]
                    assert np.abs(got - want).max() <= 1e-9 * float(p.astype(np.float64).sum()), (e8_fmt, gi)


def test_cuda_q_fragment_order_and_bit_counts():
    """The prologue writes q8 of dim d at byte (((d >> 6) * 2 + (d & 1)) * 2 + ((d >> 3) & 1)) * 16 +
    ((d >> 1) & 3) * 4 + ((d >> 4) & 3) of a row; thread (gi, ti) then loads byte j of word
    ((g * 2 + h) * 2 + b) * 16 + ti * 4 as B[k = 16 b + 4 ti + j] of int8 MMA h of group g, which the
    A operand (word 2ti + h's nibble 2j + b) pairs with dim 64 g + 16 j + 8 b + 2 ti + h. And bmma_popc's
    B columns give each thread the counts of its own four registers."""
    from ninfer.kernels.paged_decode import _CUDA_SRC
    for expr in ("(((d >> 6) * 2 + (d & 1)) * 2 + ((d >> 3) & 1)) * 16 + ((d >> 1) & 3) * 4 + ((d >> 4) & 3)",
                 "((g * 2 + h) * 2 + b) * 16 + ti * 4", "gi == 2 * ti ? 0x01111111u", "gi == 2 * ti + 1 ? 0x01111111u"):
        assert expr in _CUDA_SRC, f"CUDA source no longer has {expr!r}: update this emulation"
    for dd in (128, 256):
        at = {}
        for d in range(dd):
            i = (((d >> 6) * 2 + (d & 1)) * 2 + ((d >> 3) & 1)) * 16 + ((d >> 1) & 3) * 4 + ((d >> 4) & 3)
            assert i not in at and 0 <= i < dd
            at[i] = d
        for g in range(dd // 64):
            for h in range(2):
                for b in range(2):
                    for ti in range(4):
                        for j in range(4):
                            assert at[((g * 2 + h) * 2 + b) * 16 + ti * 4 + j] == 64 * g + 16 * j + 8 * b + 2 * ti + h
    # m16n8k256 b1: row r = chunks (a0 of threads (r, 0..3), then their a2), rows r + 8 the same with
    # a1 / a3; column n masks chunk c if thread (n, c % 4)'s b0 (c < 4) or b1 (c >= 4) is the mask
    import random
    rnd = random.Random(0)
    regs = {(gi, ti): [rnd.getrandbits(32) for _ in range(4)] for gi in range(8) for ti in range(4)}
    m = 0x01111111
    bcol = {(gi, ti): (m if gi == 2 * ti else 0, m if gi == 2 * ti + 1 else 0) for gi in range(8) for ti in range(4)}
    for gi in range(8):
        for ti in range(4):
            c = []
            for row, col in ((gi, 2 * ti), (gi, 2 * ti + 1), (gi + 8, 2 * ti), (gi + 8, 2 * ti + 1)):
                r, hi = row % 8, row // 8
                chunks = [regs[(r, k)][hi] for k in range(4)] + [regs[(r, k)][2 + hi] for k in range(4)]
                masks = [bcol[(col, k)][0] for k in range(4)] + [bcol[(col, k)][1] for k in range(4)]
                c.append(sum(_popc(x & y) for x, y in zip(chunks, masks)))
            a = regs[(gi, ti)]
            assert c == [_popc(a[0] & m), _popc(a[2] & m), _popc(a[1] & m), _popc(a[3] & m)]


def test_cuda_q_as_rounded_is_the_kernels_rounding():
    """The GPU oracle's Q (cuda_q_as_rounded) = the emulated prologue's int8 Q (_q_int8 on the rotated
    row), rotated back; several seeds and scales, D 128 and 256, a zero row."""
    import numpy as np
    import torch

    from ninfer.kernels.paged_decode_cuda import cuda_q_as_rounded
    from ninfer.kvcache.hadamard import rotate
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        for d in (128, 256):
            q = torch.randn(3, d, generator=gen, dtype=torch.float64) * (0.01 + 10 * seed)
            q[1] = 0.0
            got = rotate(cuda_q_as_rounded(q))  # rotated domain: what the MMAs multiply
            rot = rotate(q).float().numpy()
            for r in range(3):
                for g in range(d // 64):
                    q8, qsc = _q_int8(rot[r, 64 * g:64 * g + 64])
                    want = qsc * q8.astype(np.float64)
                    assert np.allclose(got[r, 64 * g:64 * g + 64].numpy(), want, rtol=1e-6, atol=1e-12 + 1e-6 * qsc)


def test_cuda_int8_operands_match_codec():
    import numpy as np

    from ninfer.kernels.paged_decode import _CUDA_SRC
    for const in ("0x64806480u", "0x80808080u", "0x4140u", "0x4342u"):
        assert const in _CUDA_SRC, f"CUDA source no longer uses {const}: update this emulation"
    # int8: x ^ 0x80808080, prmt with 0x64 bytes -> 1024 + u, minus 1152
    b8 = np.random.default_rng(3).integers(-127, 128, size=(8, 16)).astype(np.int8)
    for t in range(8):
        for s_, wd in enumerate(b8[t].view(np.uint32)):
            x = int(wd) ^ 0x80808080
            a01 = _h2(_hsub2(_prmt(x, 0x64646464, 0x4140), 0x64806480))
            a23 = _h2(_hsub2(_prmt(x, 0x64646464, 0x4342), 0x64806480))
            assert list(a01.astype(np.float32)) + list(a23.astype(np.float32)) == list(b8[t, 4 * s_:4 * s_ + 4])


def test_cuda_path_reports_why_not_on_cpu():
    import torch

    from ninfer.kernels.paged_decode import cuda_path_supported
    from ninfer.kvcache.formats import get_format

    q = torch.zeros(1, 4, 128)
    assert cuda_path_supported(q, torch.zeros(1, 1, 64, 64, dtype=torch.uint8), get_format("rk4v4-e8")) == "not on CUDA"
    assert "no CUDA path" in cuda_path_supported(q, torch.zeros(1, 1, 64, 128), get_format("bf16"))




@pytest.mark.cuda
@pytest.mark.parametrize("fmt_name", ["int8", "rk4v4", "rk4v4-e8"])
def test_cuda_path_matches_oracle_with_growing_scores(fmt_name):
    """On a GPU: the CUDA split kernel vs the float64 oracle where every later token scores higher
    (scores rise by tens of log2-units over the sequence), so the lazy rescale (running max moved only
    when a chunk exceeds it by > 8) fires many times per warp, P reaches 2^8, and a wrong rescale
    weights whole chunks wrongly. Each case also runs with one split: at the default split count a
    warp of these short sequences sees one or two chunks, too few for a second rescale. Also random
    scores, GQA 1 / 4 / 8, D 128 / 256, odd lengths; the K and V scales of unwritten slots are NaN."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.kernels.paged_decode import cuda_path_supported, paged_decode_cuda, paged_decode_ref
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    dev = torch.device("cuda")
    for seed, (hq, hkv, d, lens) in enumerate([(8, 1, 128, [3001]), (16, 4, 256, [777, 0, 64, 1]),
                                               (32, 4, 128, [5000, 129])]):
        gen = torch.Generator().manual_seed(seed)
        page = 64
        q = torch.randn(len(lens), hq, d, generator=gen)
        pages_per = [-(-n // page) for n in lens]
        tables = torch.full((len(lens), max(pages_per)), -1, dtype=torch.int32)
        perm = torch.randperm(sum(pages_per), generator=gen).to(torch.int32)
        k_all = torch.randn(sum(pages_per) * page, hkv, d, generator=gen)
        v_all = torch.randn_like(k_all)
        start = 0
        for b, n in enumerate(lens):
            tables[b, :pages_per[b]] = perm[start:start + pages_per[b]]
            if seed != 1:  # growing scores: K_t = ramp(t) * (mean q of the group), same page order
                qdir = q[b].view(hkv, hq // hkv, d).mean(1)
                ramp = torch.linspace(-4, 4, n)[:, None, None] * 200 / d ** 0.5 / qdir.norm(dim=-1, keepdim=True)
                rows = (tables[b, torch.arange(n) // page].long() * page + torch.arange(n) % page)
                k_all[rows] = ramp * qdir[None] + 0.1 * k_all[rows]
            start += pages_per[b]
        planes = {}
        for which, x in (("k", k_all), ("v", v_all)):
            data, sc = fmt.encode(x)
            planes[which] = data.view(-1, page, hkv, data.shape[-1]).transpose(1, 2).contiguous().to(dev)
            if sc is not None:
                planes[f"{which}_scale"] = sc.view(-1, page, hkv, sc.shape[-1]).transpose(1, 2).contiguous().to(dev)
        for b, n in enumerate(lens):  # slots past the end as the pool leaves them: scales may be NaN
            if n % page:
                last = int(tables[b, pages_per[b] - 1])
                for key in ("k_scale", "v_scale"):
                    planes[key][last, :, n % page:] = float("nan")
        qd, tb, sl = q.to(dev, torch.bfloat16), tables.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
        kp, vp = (planes["k"], planes.get("k_scale")), (planes["v"], planes.get("v_scale"))
        why = cuda_path_supported(qd, planes["k"], fmt)
        if why is not None:
            pytest.skip(f"CUDA path unavailable: {why}")
        ref = paged_decode_ref(qd, kp, vp, tb, sl, fmt, d ** -0.5).double()
        for splits in (None, 1, 7):  # 7: more splits than some sequences have pages (empty splits)
            out = paged_decode_cuda(qd, kp, vp, tb, sl, fmt, d ** -0.5, num_splits=splits)
            rel = float((out.double() - ref).norm() / ref.norm())
            assert torch.isfinite(out).all() and rel < 1e-2, f"{fmt_name} case {seed} splits {splits}: rel err {rel:.3e}"
            assert all(bool((out[b] == 0).all()) for b, n in enumerate(lens) if n == 0)
