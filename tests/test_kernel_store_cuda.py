"""CUDA store (csrc/store_kv.cu + csrc/kv_encode.cuh) without a GPU, and with one.

CPU: kv_encode.cuh -- the per-word rk4v4 / rk4v4-e8 encoders, rk4v4-e8's fp16-pair search (its
pairs emulated) and the code units the kernel computes -- is built for the host with g++ (no FMA
contraction, IEEE float32) and compared with
the torch reference encoder (ninfer/kvcache/e8.py) bit for bit on code units from the real
pipeline and on adversarial ones (exact ties, box edges, values past the top of the box; the
encoder's domain is z >= -8). The kernel itself is compiled with nvcc and with NVRTC for
sm_90. GPU (skipped without one): the CUDA store against the reference on the store test cases,
both kernels (lane per word below ROWS_MIN_GROUPS 64-groups per launch, thread per group from
there on: the 2100- and 3000-token cases).
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "ninfer" / "kernels" / "csrc"
sys.path.insert(0, str(ROOT))

_HOST_SRC = r'''
#include "kv_encode.cuh"
extern "C" {
void enc_words(const float* z, int n, int e8, uint32_t* out) {
  for (int i = 0; i < n; ++i) {
    float b[8];
    for (int j = 0; j < 8; ++j) b[j] = z[8 * i + j];
    out[i] = e8 ? kv::encode_e8_word(b) : kv::encode_scalar4_word(b);
  }
}
// the thread-per-group kernel's math (kv_store_rows), minus its loads, stores and fp16 conversion
void rotate_groups(const float* x, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    float a[64];
    for (int c = 0; c < 64; ++c) a[c] = x[64 * i + c];
    kv::rotate_group(a);
    for (int c = 0; c < 64; ++c) out[64 * i + c] = a[c];
  }
}
void encode_groups(const float* x, const float* s, int n, int e8, uint32_t* out) {
  for (int i = 0; i < n; ++i) {
    float a[64];
    uint32_t w[8];
    for (int c = 0; c < 64; ++c) a[c] = x[64 * i + c];
    kv::rotate_group(a);
    if (e8) kv::encode_group<3>(a, s[i] > 0.f ? 1.0f / s[i] : 0.0f, w);
    else kv::encode_group<2>(a, s[i] > 0.f ? 1.0f / s[i] : 0.0f, w);
    for (int k = 0; k < 8; ++k) out[8 * i + k] = w[k];
  }
}
// kv_store_rows' rk4v4-e8 search: blocks 2i and 2i+1 as one fp16 pair
void enc_pairs(const float* z, int n, uint32_t* out) {
  for (int i = 0; i < n; i += 2) {
    kv::h2 b[8];
    for (int j = 0; j < 8; ++j) b[j] = kv::h2_pair(z[8 * i + j], z[8 * i + 8 + j]);
    kv::encode_e8_pair(b, out[i], out[i + 1]);
  }
}
}
'''


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    """The host build of kv_encode.cuh."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("kv_encode")
    src, lib = d / "host.cpp", d / "libkvenc.so"
    src.write_text(_HOST_SRC)
    cmd = [cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
           f"-I{CSRC}", "-o", str(lib), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    so = ctypes.CDLL(str(lib))
    so.enc_words.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    so.rotate_groups.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    so.encode_groups.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    so.enc_pairs.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return so


def _host_words(lib, z: torch.Tensor, e8: bool) -> torch.Tensor:
    """Code units z [N, 64] -> int32 words [N, 8] from the host build (word w = coordinates 8j + w)."""
    from ninfer.kvcache.e8 import to_blocks

    blocks = np.ascontiguousarray(to_blocks(z.to(torch.float32)).reshape(-1, 8).numpy())
    out = np.zeros(blocks.shape[0], dtype=np.uint32)
    lib.enc_words(blocks.ctypes.data, blocks.shape[0], int(e8), out.ctypes.data)
    return torch.from_numpy(out.view(np.int32)).reshape(z.shape[0], 8)


def _code_units(seed: int, n: int) -> torch.Tensor:
    """z from the reference pipeline (rotate, fp16 scale, divide) plus adversarial rows."""
    from ninfer.kvcache.formats import code_units, group_scales
    from ninfer.kvcache.hadamard import rotate

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g) * torch.exp(torch.randn(n, 1, generator=g).clamp(-3, 3) * 2)
    x[: n // 8, 3] *= 40  # outlier channel
    xr = rotate(x)
    _, s = group_scales(xr, 8.0, round_up=True)
    z = code_units(xr, s)
    # the encoder's domain is z >= -8 (kv_encode.cuh): code units of the 4-bit formats lie in [-8, 8]
    q = torch.randint(-32, 36, (n // 2, 64), generator=g).to(torch.float32) / 4  # ties, past the box
    u = (torch.rand(n // 2, 64, generator=g) * 17 - 8).to(torch.float32)  # uniform over and past the box
    e = torch.tensor([7.0, -8.0, 7.5, -7.75, 8.004, -7.996, 6.5, -7.5], dtype=torch.float32)
    edges = e[torch.randint(0, 8, (n // 4, 64), generator=g)]
    return torch.cat([z, q, u, edges, torch.zeros(1, 64), torch.full((1, 64), 0.25)])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fmt", ["rk4v4", "rk4v4-e8"])
def test_host_encoder_matches_reference(host_lib, seed, fmt):
    from ninfer.kvcache.e8 import encode_e8, encode_scalar4

    z = _code_units(seed, 4096)
    ref = (encode_e8(z) if fmt == "rk4v4-e8" else encode_scalar4(z)).view(torch.int32)
    got = _host_words(host_lib, z, fmt == "rk4v4-e8")
    bad = (got != ref).any(dim=1)
    assert not bad.any(), f"{int(bad.sum())} of {len(z)} groups differ, first: {z[bad][0].tolist()}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_pair_encoder_matches_reference(host_lib, seed):
    """The fp16-pair search (two words per instruction, kv_store_rows) on code units on the 2^-8
    grid in [-8, 8] (what rk4v4-e8 encodes): bit for bit the reference encoder's words, ties and box
    edges included. Every rounding of the pairs is emulated on the host, so a wrong fp16 bit trick,
    mask or word order fails here."""
    from ninfer.kvcache.e8 import GRID, encode_e8, to_blocks

    z = (_code_units(seed, 4096) / GRID).round().clamp(-8 / GRID, 8 / GRID) * GRID
    ref = encode_e8(z).view(torch.int32)
    blocks = np.ascontiguousarray(to_blocks(z).reshape(-1, 8).numpy())
    out = np.zeros(blocks.shape[0], dtype=np.uint32)
    host_lib.enc_pairs(blocks.ctypes.data, blocks.shape[0], out.ctypes.data)
    got = torch.from_numpy(out.view(np.int32)).reshape(z.shape[0], 8)
    bad = (got != ref).any(dim=1)
    assert not bad.any(), f"{int(bad.sum())} of {len(z)} groups differ, first: {z[bad][0].tolist()}"
    assert torch.equal(got, _host_words(host_lib, z, True))  # and the float32 search agrees


def test_host_encoder_detects_a_wrong_tie_rule(host_lib):
    """The comparison above can fail: the reference with ties going to the half coset differs."""
    from ninfer.kvcache import e8 as e8mod

    z = _code_units(5, 1024)
    zb = e8mod.to_blocks(z)
    n0, n1, half = e8mod.coset_candidates(zb)
    d0 = ((zb.double() - n0.double()) ** 2).sum(-1)
    d1 = ((zb.double() - n1.double() - 0.5) ** 2).sum(-1)
    tie = (d1 == d0) & ((zb * 4).round() == zb * 4).all(-1)  # exact ties (quarter-grid rows)
    assert bool(tie.any()), "the inputs must contain coset ties"
    got = _host_words(host_lib, z, True)
    ref = e8mod.encode_e8(z).view(torch.int32)
    assert torch.equal(got, ref)
    wrong_half = half | tie  # the wrong rule
    n = torch.where(wrong_half[..., None], n1, n0)
    u = n + 8
    u[..., 7] = (u[..., 7] & 0xE) | wrong_half.to(torch.int32)
    wrong = e8mod.pack_nibbles(u).view(torch.int32)
    assert not torch.equal(got, wrong)


@pytest.mark.parametrize("seed", [0, 1])
def test_host_group_pipeline_matches_reference(host_lib, seed):
    """kv_store_rows' math (sign pattern, butterfly, x 1/8 with the output signs, x 1/s, lattice
    search) on inputs whose rotation is exact: the butterfly of S.x equals 8 x H64.S.x and the words
    equal the reference encoder's, for both 4-bit formats."""
    from tests.triton_interp import exact_values
    from ninfer.kvcache.formats import get_format, group_scales
    from ninfer.kvcache.hadamard import rotate, sign_pattern

    g = torch.Generator().manual_seed(seed)
    x = exact_values(g, (2048, 64), torch.float32, -12, 12)
    x[:8] = 0.0  # all-zero groups
    x[8:16, 5] = 3.0  # one spike: every rotated value has the same magnitude (z = +-8, the box edges)
    xs = np.ascontiguousarray(x.numpy())
    rot = np.zeros_like(xs)
    host_lib.rotate_groups(xs.ctypes.data, len(xs), rot.ctypes.data)
    assert torch.equal(torch.from_numpy(rot) * (0.125 * sign_pattern()), rotate(x))  # R = S.H64.S
    _, sc = group_scales(rotate(x), 8.0, round_up=True)
    s = np.ascontiguousarray(sc.reshape(-1).numpy())
    for name in ("rk4v4", "rk4v4-e8"):
        out = np.zeros(len(xs) * 8, dtype=np.uint32)
        host_lib.encode_groups(xs.ctypes.data, s.ctypes.data, len(xs), int(name == "rk4v4-e8"), out.ctypes.data)
        ref = get_format(name).encode(x)[0].view(torch.int32).reshape(-1)
        got = torch.from_numpy(out.view(np.int32))
        assert torch.equal(got, ref), f"{name}: {int((got != ref).sum())} words differ"


@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_cuda_store_compiles_for_sm90(tmp_path, monkeypatch, compiler):
    """The store kernel builds for Hopper in both formats, bf16 / fp16, int32 / int64 slots, with nvcc
    and with NVRTC (no CUDA toolkit needed); a compiler that is not installed skips."""
    from ninfer.kernels import cuda_build, nvrtc
    from ninfer.kernels import store_kv_cuda as sc
    from ninfer.kernels._common import FMT_E8, FMT_RK4

    if compiler == "nvcc" and cuda_build.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    if compiler == "nvrtc":
        if nvrtc.unavailable():
            pytest.skip(nvrtc.unavailable())
        monkeypatch.setattr(cuda_build, "nvcc_path", lambda: None)
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    for code in (FMT_RK4, FMT_E8):
        for xt in (torch.bfloat16, torch.float16):
            for st in (torch.int32, torch.int64):
                cubin = sc._STORE.build_defs(sc.defs(code, xt, st), "sm_90")
                assert cubin.stat().st_size > 1000


def test_cuda_path_reasons(monkeypatch):
    """The startup log's reasons a geometry falls back to Triton (a CUDA device stubbed: sm_90)."""
    from ninfer.kernels import paged_decode_cuda as pdc
    from ninfer.kernels.paged_decode_cuda import cuda_decode_unsupported
    from ninfer.kernels.store_kv_cuda import cuda_store_unsupported
    from ninfer.kvcache.formats import get_format as F

    monkeypatch.setattr(pdc, "_capability", lambda device: (9, 0))
    cpu, gpu, bf = torch.device("cpu"), torch.device("cuda"), torch.bfloat16
    assert cuda_decode_unsupported(F("bf16"), gpu, bf, 128, 32, 8, 64) == "format bf16 has no CUDA path"
    assert cuda_decode_unsupported(F("rk4v4-e8"), cpu, bf, 128, 32, 8, 64) == "not on CUDA"
    assert cuda_decode_unsupported(F("rk4v4-e8"), gpu, bf, 96, 32, 8, 64) == "head_dim 96: CUDA path needs 128 or 256"
    assert cuda_decode_unsupported(F("rk4v4-e8"), gpu, bf, 128, 32, 2, 64) == "GQA group 16 > 8"
    assert cuda_decode_unsupported(F("int8"), gpu, torch.float32, 128, 32, 8, 64) == "q dtype torch.float32"
    monkeypatch.setattr(pdc, "_capability", lambda device: (7, 5))
    assert cuda_decode_unsupported(F("int8"), gpu, bf, 128, 32, 8, 64) == "needs sm_80+"
    assert cuda_store_unsupported(F("int8"), gpu, bf, 128) == "format int8 has no CUDA store"
    assert cuda_store_unsupported(F("rk4v4-e8"), cpu, bf, 256) == "not on CUDA"
    assert cuda_store_unsupported(F("rk4v4"), gpu, torch.float32, 128) == "input dtype torch.float32"
    assert cuda_store_unsupported(F("rk4v4-e8"), gpu, bf, 192).startswith("head_dim 192")


def test_kernel_backend_reports_its_kernel_paths(monkeypatch):
    """The startup line on a CUDA machine, computed without one (capability, compilers and kernel
    loading stubbed): store, decode, prefill in that order, with the reason a CUDA path is passed over."""
    from types import SimpleNamespace

    from ninfer.attention.triton_backend import KernelAttentionBackend
    from ninfer.kernels import paged_decode_cuda as pdc
    from ninfer.kernels import store_kv_cuda as sc
    from ninfer.kvcache.formats import get_format

    monkeypatch.setattr(pdc, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(pdc, "load_decode_cuda", lambda *a, **k: None)
    monkeypatch.setattr(sc, "load_store_cuda", lambda *a, **k: None)
    dev = torch.device("cuda")
    none = "no nvcc, and NVRTC: libnvrtc not found"
    for why, fmt, d, want in (
            (None, "rk4v4-e8", 128, "store=cuda decode=cuda prefill=sdpa"),
            (None, "int8", 128, "store=triton (format int8 has no cuda store kernel) decode=cuda prefill=sdpa"),
            (None, "rk4v4", 64, "store=cuda decode=triton (head_dim 64: CUDA path needs 128 or 256) prefill=sdpa"),
            (none, "rk4v4-e8", 128, f"store=triton ({none}) decode=triton ({none}) prefill=sdpa")):
        monkeypatch.setattr(pdc, "_compiler", lambda why=why: why)
        monkeypatch.setattr(sc, "compiler_unavailable", lambda why=why: why)
        pool = SimpleNamespace(fmt=get_format(fmt), device=dev, head_dim=d, num_kv_heads=8, page_size=64)
        assert KernelAttentionBackend(pool, dtype=torch.bfloat16, num_heads=32).kernel_paths() == want


GPU_CASES = [("rk4v4-e8", "random", 37, 2, 128, "bfloat16", 0), ("rk4v4", "random", 37, 2, 128, "bfloat16", 1),
             ("rk4v4-e8", "adversarial", 21, 2, 128, "bfloat16", 7), ("rk4v4", "adversarial", 21, 2, 128, "bfloat16", 7),
             ("rk4v4-e8", "random", 5, 1, 256, "float16", 11), ("rk4v4-e8", "random", 1, 8, 128, "bfloat16", 21),
             ("rk4v4-e8", "random", 70, 2, 256, "bfloat16", 14), ("rk4v4-e8", "random", 3000, 8, 128, "bfloat16", 30),
             ("rk4v4", "random", 3000, 4, 256, "bfloat16", 31), ("rk4v4-e8", "adversarial", 2100, 8, 128, "bfloat16", 32),
             ("rk4v4", "random", 65, 3, 128, "float16", 33), ("rk4v4-e8", "random", 100, 1, 64, "bfloat16", 34)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-{c[1]}-t{c[2]}-h{c[3]}-d{c[4]}-{c[5]}" for c in GPU_CASES])
def test_cuda_store_bit_exact(case):
    from ninfer.kernels import store_kv_cuda as sc
    from tests.test_kernel_store import _run_case

    if sc.compiler_unavailable():
        pytest.skip(sc.compiler_unavailable())
    r = _run_case("gpu", *case, device="cuda", backend="cuda")
    assert r["stored"] > 0
    assert all(v == 0 for v in r["mismatched_bytes"].values()), f"planes differ from the reference: {r}"
