"""The CUDA paged-decode kernel's build (nvcc and NVRTC for sm_90, no GPU needed), its 4-bit stage
layout and shared-memory budget, and on a GPU a 262K-token split against the float64 oracle."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_cuda_kernel_compiles_for_sm90(tmp_path, monkeypatch, compiler):
    """The CUDA decode kernel (and its headers) builds for Hopper in every format and head dim the
    engine uses, from the files the package ships, with nvcc and with NVRTC (what a machine without
    the CUDA toolkit uses: the library torch's CUDA wheels install); no GPU needed. A compiler that
    is not installed skips (CI installs NVRTC with the test extras)."""
    from ninfer.kernels import cuda_build, nvrtc
    from ninfer.kernels.paged_decode_cuda import _CUDA, _key
    from ninfer.kvcache.formats import get_format

    if compiler == "nvcc" and cuda_build.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    if compiler == "nvrtc":
        if nvrtc.unavailable():
            pytest.skip(nvrtc.unavailable())
        monkeypatch.setattr(cuda_build, "nvcc_path", lambda: None)
    assert cuda_build.compiler_name().startswith(compiler)
    import torch
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    for name in ("int8", "rk4v4", "rk4v4-e8"):
        for d in (64, 128, 256):
            cubin = _CUDA.build(_key(get_format(name).kernel_code, d, torch.bfloat16), "sm_90")
            assert cubin.is_file() and cubin.stat().st_size > 10_000, (name, d)


def test_cuda_4bit_stage_layout_reads_what_the_copies_wrote():
    """The 4-bit stage rows of ``csrc/paged_decode.cu`` (k_at) and the loop's read bases (kbase /
    vbase XOR g << 5): every 16-byte piece the copies write lands in its own slot with its 32-byte
    sector whole and each copy's 8-lane pass fills one 128-byte line; every K and V read lands on the
    byte k_at put there; and at D256 the reads meet no bank conflict (K: 8 rows x 32 B in 2
    wavefronts, V: 4 rows x 32 B in 1)."""
    from ninfer.kernels.paged_decode import _CUDA_SRC
    for expr in ("const int f = SW ? (t >> 1) & 3 : 0;", "constexpr bool SW = FMT != 1 && D == 256;",
                 "return t * RB + (((c >> 1) ^ f) << 5) + ((c & 1) << 4);",
                 "const int kbase = k_at(gi, 0) + ti * 8;",
                 "vbase0 = k_at(2 * ti, 0) + gi * 4, vbase1 = k_at(2 * ti + 1, 0) + gi * 4;",
                 "(kbase ^ (g << 5)) + sub * 16 * RB", "(vbase0 ^ (g << 5)) + sub * 16 * RB",
                 "const int ta = sub * 16 + gi, tb = ta + 8;"):
        assert expr in _CUDA_SRC, f"CUDA source no longer has {expr!r}: update this emulation"

    def wavefronts(addrs, width):  # shared-memory passes for one warp-wide load of `width` bytes each
        banks: dict[int, set] = {}
        for a in addrs:
            for w in range(a // 4, (a + width) // 4):
                banks.setdefault(w % 32, set()).add(w)
        return max(len(v) for v in banks.values())

    for d, chunk in ((128, 64), (256, 32)):
        rb = d // 2

        def k_at(t, c):
            f = (t >> 1) & 3 if d == 256 else 0
            return t * rb + (((c >> 1) ^ f) << 5) + ((c & 1) << 4)

        slots = {k_at(t, c) for t in range(chunk) for c in range(rb // 16)}
        assert len(slots) == chunk * rb // 16 and min(slots) == 0 and max(slots) == chunk * rb - 16
        assert all((k_at(t, c) ^ k_at(t, c ^ 1)) == 16 for t in range(chunk) for c in range(0, rb // 16, 2))
        nch = rb // 16  # copies: lane l writes piece l % nch of token l // nch (+ 32 // nch per step); each
        for i in range(chunk * nch // 32):  # quarter warp's 8 pieces in one pass (H200: 1.19-1.32x when not)
            dst = [k_at(lane // nch + i * (32 // nch), lane % nch) for lane in range(32)]
            assert all(wavefronts(dst[q:q + 8], 16) == 1 for q in range(0, 32, 8)), (d, i)
        for sub in range(chunk // 16):
            for g in range(d // 64):
                k_rows, v_rows = [], {e: [] for e in (0, 1, 8, 9)}
                for lane in range(32):
                    gi, ti = lane >> 2, lane & 3
                    kbase = k_at(gi, 0) + ti * 8
                    for half in (0, 8):  # wa (row gi), wb (row gi + 8)
                        got = (kbase ^ (g << 5)) + sub * 16 * rb + half * rb
                        t, byte = sub * 16 + gi + half, g * 32 + ti * 8
                        assert got == k_at(t, byte >> 4) + (byte & 15), (d, sub, g, lane)
                        if half == 0:
                            k_rows.append(got)
                    vb = {0: k_at(2 * ti, 0) + gi * 4, 1: k_at(2 * ti + 1, 0) + gi * 4}
                    for e in (0, 1, 8, 9):
                        got = (vb[e & 1] ^ (g << 5)) + sub * 16 * rb + (e & 8) * rb
                        t, byte = sub * 16 + 2 * ti + e, g * 32 + gi * 4
                        assert got == k_at(t, byte >> 4) + (byte & 15), (d, sub, g, lane, e)
                        v_rows[e].append(got)
                if d == 256:  # D128: linear rows, K and V reads 4-way (cheaper than avoiding it)
                    assert wavefronts(k_rows, 8) == 2, (d, sub, g)
                    assert all(wavefronts(v, 4) == 1 for v in v_rows.values()), (d, sub, g)


def test_default_configs_fit_in_shared_memory():
    """Every format and head dim's default configuration fits its blocks per SM in an H100/H200 SM's
    shared memory (a configuration that does not fails only at launch, on a GPU)."""
    import torch
    from ninfer.kernels.paged_decode_cuda import _cuda_smem_bytes, _key
    from ninfer.kvcache.formats import get_format

    per_block_max, per_sm = 227 * 1024, 228 * 1024  # sm_90 opt-in limit; 1 KiB of each block is reserved
    for name in ("int8", "rk4v4", "rk4v4-e8"):
        for d in (128, 256):
            key = _key(get_format(name).kernel_code, d, torch.bfloat16)
            nw, minb, g = key[3], key[6], d // 64
            static = 8 * d * 4 + 2 * nw * 8 * 4 + 8 * g * 4 + 8 * g * 16 * 2  # q_s, m_s + l_s, c_s, wf_s
            total = _cuda_smem_bytes(key) + static
            assert total <= per_block_max and minb * (total + 1024) <= per_sm, (name, d, key, total)


def test_nvrtc_reports_a_compile_error():
    """A source NVRTC cannot compile raises with the compiler's own message, not a bare status."""
    from ninfer.kernels import nvrtc

    if nvrtc.unavailable():
        pytest.skip(nvrtc.unavailable())
    files = {"bad.cu": '#include "h.cuh"\nextern "C" __global__ void k() { undeclared_name = 1; }\n', "h.cuh": "#pragma once\n"}
    with pytest.raises(RuntimeError, match=r"bad\.cu failed to compile for sm_90:(.|\n)*undeclared_name"):
        nvrtc.compile_cubin(files, "bad.cu", {}, "sm_90")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("fmt_name", ["int8", "rk4v4", "rk4v4-e8"])
def test_long_split_matches_oracle(fmt_name, backend):
    """On a GPU: each split kernel (Triton, CUDA) over ONE split of 262,144 tokens vs the float64
    oracle. Random q and K make the softmax nearly flat, so the output is a mean of V, small against any
    constant the accumulators carry. The 4-bit V accumulators once carried a +8 code bias for the
    whole split, removed only at the end: the tensor cores' fp32 accumulation error grew with the
    split (the kernel bench: rel. error 1.7e-2 at 512K, batch 8). Short splits elsewhere stay near
    2e-3, so 5e-3 is the bound. The CUDA 4-bit kernel scores against Q rounded to int8; its oracle gets
    that Q (cuda_q_as_rounded), and against the exact Q the output may differ by the score noise the
    rounding adds (in a flat softmax the relative error is about that noise: 6.5e-3 measured)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.kernels.paged_decode import cuda_path_supported, paged_decode_cuda, paged_decode_ref, paged_decode_triton
    from ninfer.kernels.paged_decode_cuda import cuda_q_as_rounded
    from ninfer.kvcache.formats import get_format

    fmt, dev, page = get_format(fmt_name), torch.device("cuda"), 64
    hq, hkv, d, n = 8, 1, 128, 262144
    gen = torch.Generator(device=dev).manual_seed(5)
    planes = {}
    for which in ("k", "v"):
        data, sc = fmt.encode(torch.randn(n, hkv, d, device=dev, generator=gen))
        planes[which] = data.view(-1, page, hkv, data.shape[-1]).transpose(1, 2).contiguous()
        planes[f"{which}_scale"] = sc.view(-1, page, hkv, sc.shape[-1]).transpose(1, 2).contiguous()
    tables = torch.randperm(n // page, device=dev, generator=gen).to(torch.int32)[None]
    q = torch.randn(1, hq, d, device=dev, generator=gen).to(torch.bfloat16)
    sl = torch.tensor([n], dtype=torch.int32, device=dev)
    kp, vp = (planes["k"], planes["k_scale"]), (planes["v"], planes["v_scale"])
    if backend == "cuda" and (why := cuda_path_supported(q, planes["k"], fmt)) is not None:
        pytest.skip(f"CUDA path unavailable: {why}")
    rounded_q = backend == "cuda" and fmt.rotated
    q_ref = cuda_q_as_rounded(q) if rounded_q else q
    ref = paged_decode_ref(q_ref, kp, vp, tables, sl, fmt, d ** -0.5).double()
    decode = paged_decode_cuda if backend == "cuda" else paged_decode_triton
    out = decode(q, kp, vp, tables, sl, fmt, d ** -0.5, num_splits=1)
    rel = float((out.double() - ref).norm() / ref.norm())
    print(f"{fmt_name} {backend}: rel err {rel:.3e}")
    assert torch.isfinite(out).all() and rel < 5e-3, f"{fmt_name} {backend}: rel err {rel:.3e}"
    if rounded_q:  # the rounding's own share, against the exact Q
        exact = paged_decode_ref(q, kp, vp, tables, sl, fmt, d ** -0.5).double()
        rel_q = float((out.double() - exact).norm() / exact.norm())
        print(f"{fmt_name} {backend}: rel err against the exact Q {rel_q:.3e}")
        assert rel_q < 1.5e-2, f"{fmt_name} {backend}: rel err against the exact Q {rel_q:.3e}"
