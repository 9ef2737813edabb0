"""Paged decode kernel (ninfer/kernels/paged_decode.py) vs its torch oracle, on CPU.

How the interpreter is enabled: Triton decides at ``@triton.jit`` time (module import) whether a
kernel is interpreted, and other test modules may already have imported Triton or the kernel
modules in this pytest process. So the checks run in ONE child process started with
``TRITON_INTERPRET=1`` in its environment (``python tests/test_kernel_decode.py --child``); it
runs every case and prints one JSON line per case; the tests here assert on those lines. This is
independent of test order, of conftest files and of what the parent imported.

What is checked, per case (fresh random inputs from the case's seed; all formats):
* every output element written (the output buffer is poisoned with NaN first);
* ``||out - ref|| / ||ref|| <= tol`` with ``ref = paged_decode_ref`` (planes decoded by the format
  registry's reference decode, float64 attention);
* odd lengths, lengths at / across page boundaries, a batch with different lengths (one of them
  0), GQA 1 / 4 / 6, head_dim 128 and 256, shuffled (non-contiguous) block tables, several splits.

Tolerances: the kernel feeds fp16 (quantized formats) or bf16 (bf16 planes) operands to the
dots and rounds P to fp16/bf16 before the PV product, everything else in float32; the
reference decodes the *same* stored codes, so quantization error is not part of the comparison.
bf16 operands carry ~2^-9 relative rounding per element -> observed relative error a few 1e-3;
fp16 ~2^-12 -> ~1e-3. Bounds: 2e-2 for bf16 planes, 1e-2 otherwise (a wrong nibble, a missed
coset bit or a wrong page gives errors of order 1e-1 .. 1).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.triton_interp import child_main, case_result, module_results  # noqa: E402
FORMATS = ("auto", "bf16", "int8", "rk4v4", "rk4v4-e8")

# (name, fmt, hq, hkv, d, lens, page, splits, seed)
CASES = []
for _f in FORMATS:
    CASES.append((f"{_f}-gqa6-d256", _f, 6, 1, 256, [131], 64, 2, 1))
    CASES.append((f"{_f}-gqa4-d128-batch", _f, 8, 2, 128, [1, 64, 0, 200], 64, 3, 2))
for _f in ("int8", "rk4v4", "rk4v4-e8"):
    CASES.append((f"{_f}-gqa1-d128-page16", _f, 2, 2, 128, [17, 48], 16, 2, 3))
CASES.append(("rk4v4-e8-gqa4-d128-seed4", "rk4v4-e8", 4, 1, 128, [65, 127], 64, 1, 4))
CASES.append(("rk4v4-e8-gqa6-d256-seed5", "rk4v4-e8", 12, 2, 256, [192], 64, 5, 5))

TOL = {"auto": 2e-2, "bf16": 2e-2}


def _run_case(name, fmt_name, hq, hkv, d, lens, page, splits, seed):
    import torch

    from ninfer.kernels.paged_decode import paged_decode, paged_decode_ref
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    pages_per_seq = [max(1, -(-n // page)) for n in lens]
    num_pages = sum(pages_per_seq) + 3
    model_dtype = torch.bfloat16
    planes = {}
    for pl in fmt.planes(d, model_dtype):
        planes[pl.name] = torch.zeros(num_pages, hkv, page, pl.extent, dtype=pl.dtype)
    # Random page ids: each sequence gets a shuffled, non-contiguous set of pages.
    perm = torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per_seq) + 1
    bt = torch.full((bsz, max_pages), -1, dtype=torch.int32)
    pos = 0
    for b, npg in enumerate(pages_per_seq):
        bt[b, :npg] = perm[pos:pos + npg].to(torch.int32)
        pos += npg
    # Fill every page of the pool with encoded random K/V (also pages nobody reads).
    for which in ("k", "v"):
        x = torch.randn(num_pages, hkv, page, d, generator=gen)
        # a few outlier channels, like real K
        x[..., : d // 16] *= 4.0
        data, sc = fmt.encode(x.to(model_dtype))
        planes[which].copy_(data.to(planes[which].dtype))
        if sc is not None:
            planes[f"{which}_scale"].copy_(sc)
    q = torch.randn(bsz, hq, d, generator=gen).to(model_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((bsz, hq, d), float("nan"), dtype=model_dtype)
    scale = d ** -0.5
    kp = (planes["k"], planes.get("k_scale"))
    vp = (planes["v"], planes.get("v_scale"))
    paged_decode(q, kp, vp, bt, seq_lens, fmt_name, scale, num_splits=splits, out=out)
    ref = paged_decode_ref(q, kp, vp, bt, seq_lens, fmt_name, scale)
    o = out.to(torch.float32)
    finite = bool(torch.isfinite(o).all())
    rel = float((o - ref).norm() / ref.norm().clamp_min(1e-30)) if finite else float("nan")
    empty_ok = all(bool((o[b] == 0).all()) for b, n in enumerate(lens) if n == 0)
    return {"name": name, "finite": finite, "rel": rel, "empty_ok": empty_ok}


def _child() -> int:
    return child_main(CASES, _run_case)


results = module_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_decode_matches_reference(results, case):
    r = case_result(results, case[0])
    assert r["finite"], "NaN/Inf in output: some element was not written"
    assert r["empty_ok"], "a zero-length sequence must give zeros"
    tol = TOL.get(case[1], 1e-2)
    assert r["rel"] <= tol, f"relative error {r['rel']:.3e} > {tol}"


def test_wrapper_rejects_bad_shapes():
    import torch

    from ninfer.kernels.paged_decode import paged_decode

    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 1, 64, 64, dtype=torch.uint8)
    ks = torch.zeros(2, 1, 64, 2, dtype=torch.float16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError):
        paged_decode(q, (k, ks), (k, ks), bt, sl.long(), "rk4v4-e8", 0.1)  # seq_lens dtype
    with pytest.raises(ValueError):
        paged_decode(q, (k, None), (k, ks), bt, sl, "rk4v4-e8", 0.1)  # missing scale
    with pytest.raises(ValueError):
        paged_decode(q, (k.view(torch.int8), ks), (k, ks), bt, sl, "rk4v4-e8", 0.1)  # dtype
    with pytest.raises(ValueError):
        paged_decode(q[:, :3], (k, ks), (k, ks), bt, sl, "int8", 0.1)  # int8 extent is D


# ----------------------------------------------------------------------------- CUDA path arithmetic
# The CUDA split kernel (``_CUDA_SRC`` in paged_decode.py) turns stored words into fp16 MMA
# operands with a few PTX bit tricks. They cannot run here, so this test emulates exactly those
# operations in numpy (lop3 (a & m) | b, prmt, sub/fma.f16x2 with fp16 rounding) and checks them
# bit-exactly against the codec's reference decode. The GPU benchmark checks the whole kernel.
def _h2(u32):
    import numpy as np
    return np.array([u32 & 0xFFFF, u32 >> 16], dtype=np.uint16).view(np.float16)


def _u32(h):
    import numpy as np
    a = np.asarray(h, dtype=np.float16).view(np.uint16).astype(np.uint32)
    return int(a[0] | (a[1] << 16))


def _hsub2(a, b):
    return _u32(_h2(a) - _h2(b))


def _hfma2(a, b, c):
    import numpy as np
    return _u32((_h2(a).astype(np.float64) * _h2(b) + _h2(c)).astype(np.float16))


def _lop(a, m, b):
    return ((a & m) | b) & 0xFFFFFFFF


def _prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _e8_fix(w):
    return w ^ ((((w & 0x11111111) * 0x11111111) & 0xFFFFFFFF) & 0x10000000)


def _k_word(w, e8):
    if e8:
        c = (w >> 28) & 1
        w = _e8_fix(w)
        lo_sub, hi_base = 0x48004800 - c * 0x00800080, 0x64006400 | (c * 0x00080008)
    else:
        lo_sub, hi_base = 0x48004800, 0x64006400
    y = w >> 8
    return [_hsub2(_hsub2(_lop(w, 0x000F000F, 0x64006400), 0x64006400), lo_sub),
            _hfma2(_lop(w, 0x00F000F0, hi_base), 0x2C002C00, 0xD480D480),
            _hsub2(_hsub2(_lop(y, 0x000F000F, 0x64006400), 0x64006400), lo_sub),
            _hfma2(_lop(y, 0x00F000F0, hi_base), 0x2C002C00, 0xD480D480)]


def test_cuda_word_conversions_match_codec():
    import numpy as np
    import torch

    from ninfer.kernels.paged_decode import _CUDA_SRC
    from ninfer.kvcache import e8

    for const in ("0x48004800u", "0x64006400u", "0x2C002C00u", "0xD480D480u", "0x11111111u", "0x64806480u",
                  "0x80808080u", "0x4140u", "0x4342u"):
        assert const in _CUDA_SRC, f"CUDA source no longer uses {const}: update this emulation"
    z = torch.randn(40, 64, generator=torch.Generator().manual_seed(7)) * 3
    z[0] = 0.0
    z[1] = 100.0  # box corners
    for e8_fmt in (True, False):
        data = (e8.encode_e8(z) if e8_fmt else e8.encode_scalar4(z))
        ref = (e8.decode_e8(data) if e8_fmt else e8.decode_scalar4(data)).numpy()
        words = data.numpy().view(np.uint32)  # [40, 8]
        for t in range(40):
            for w in range(8):
                # K operand: word -> (nibble s, nibble s+4) = dims (8s + w, 8(s+4) + w)
                for s_, pair in enumerate(_k_word(int(words[t, w]), e8_fmt)):
                    assert list(_h2(pair).astype(np.float32)) == [ref[t, 8 * s_ + w], ref[t, 8 * (s_ + 4) + w]]
        if not e8_fmt:
            continue
        for t in range(0, 40, 2):  # V operand: byte q of two tokens -> dims 16q + w (low), 16q + 8 + w (high)
            for w in range(8):
                wa, wb = int(words[t, w]), int(words[t + 1, w])
                ca, cb = (wa >> 28) & 1, (wb >> 28) & 1
                wa, wb = _e8_fix(wa), _e8_fix(wb)
                lo_sub = 0x48004800 - (ca * 0x80 + cb * 0x00800000)
                hi_base = 0x64006400 | (ca << 3) | (cb << 19)
                for q in range(4):
                    x = _prmt(wa, wb, q | (q << 4) | ((q + 4) << 8) | ((q + 4) << 12))
                    lo = _h2(_hsub2(_hsub2(_lop(x, 0x000F000F, 0x64006400), 0x64006400), lo_sub))
                    hi = _h2(_hfma2(_lop(x, 0x00F000F0, hi_base), 0x2C002C00, 0xD480D480))
                    assert list(lo.astype(np.float32)) == [ref[t, 16 * q + w], ref[t + 1, 16 * q + w]]
                    assert list(hi.astype(np.float32)) == [ref[t, 16 * q + 8 + w], ref[t + 1, 16 * q + 8 + w]]
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

    q = torch.zeros(1, 4, 128)
    assert cuda_path_supported(q, torch.zeros(1, 1, 64, 64, dtype=torch.uint8), "rk4v4-e8") == "not on CUDA"
    assert "no CUDA path" in cuda_path_supported(q, torch.zeros(1, 1, 64, 128), "bf16")


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())


@pytest.mark.cuda
@pytest.mark.parametrize("fmt_name", ["int8", "rk4v4", "rk4v4-e8"])
def test_cuda_path_matches_oracle_with_growing_scores(fmt_name):
    """On a GPU: the CUDA split kernel vs the float64 oracle where every later token scores higher
    (scores rise by tens of log2-units over the sequence), so the lazy rescale (running max moved only
    when a chunk exceeds it by > 8) fires many times per split, P reaches 2^8, and a wrong rescale
    weights whole chunks wrongly. Also random scores, GQA 1 / 4 / 8, D 128 / 256, odd lengths."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.kernels.paged_decode import cuda_path_supported, paged_decode, paged_decode_ref
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    dev = torch.device("cuda")
    for seed, (hq, hkv, d, lens) in enumerate([(8, 1, 128, [3001]), (16, 4, 256, [777, 64, 1]),
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
        qd, tb, sl = q.to(dev, torch.bfloat16), tables.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
        kp, vp = (planes["k"], planes.get("k_scale")), (planes["v"], planes.get("v_scale"))
        why = cuda_path_supported(qd, planes["k"], fmt_name)
        if why is not None:
            pytest.skip(f"CUDA path unavailable: {why}")
        out = paged_decode(qd, kp, vp, tb, sl, fmt_name, d ** -0.5, backend="cuda")
        ref = paged_decode_ref(qd, kp, vp, tb, sl, fmt_name, d ** -0.5)
        rel = float((out.double() - ref.double()).norm() / ref.double().norm())
        assert torch.isfinite(out).all() and rel < 1e-2, f"{fmt_name} case {seed}: rel err {rel:.3e}"
