"""Quantized-weight GEMMs (ninfer/kernels/fp8_gemm.py, nvfp4_gemm.py) against float64 references.

Interpreter: every kernel check runs in one child process with ``TRITON_INTERPRET=1``
(tests/triton_interp.py says why and how).

Bound, per output element: |y - ref| <= 2^-7 |ref| + 2^-14 (|x| @ |w|^T), ref the float64 product
of what the checkpoint means (``*_ref`` beside each kernel). The first term is the output rounding
(bf16/fp16; the interpreter truncates instead of rounding, hence a full ulp); the second covers
the fp32 accumulation and split-K sums. A case reports the worst ratio error / bound (<= 1 passes).
Weight dequantization is exact in the 16-bit MMA operand (e4m3, and e2m1 x e4m3), so a wrong
scale index, a wrong nibble order or a wrong K offset moves outputs by O(|x| @ |w| / sqrt(K)),
hundreds of times the second term: negative controls run the same check on a swapped nibble
order (kernel) and on a scale block index off by one (reference) and must exceed the bound.
W8A8 (prefill) is checked against the float64 product of the quantized activations it used,
whose quantization must equal torch's own e4m3 cast bit for bit, and within 6% (Frobenius) of
the unquantized product. NVFP4 weights come from compressed-tensors' own compressor (NVFP4A16
scheme), and its decompressor and unpacker must agree with our reference dequantization.
Small-M cases with 2 and 4 K splits check the in-kernel split reduction, and every case that the
split-K ticket counters are left zeroed. The GEMV (qgemv.py, the default up to qgemv.GEMV_M rows per format) runs
M = 1..9 with ragged N and K, several tile configs, bias on and off, bf16 and fp16 x, against float64,
against the tl.dot path, and with a scale one block / group off in K read by the kernel (must fail the
bound); its sm90 compile is checked on CPU for what keeps it at copy bandwidth (no layout conversion of
the weight tile, vector loads). On a GPU (``cuda``): every path at Qwen3-8B shapes
(M 1 / 16 / 64 / 4096) under the same bound (W8A8: 2^-10 accumulation term, the FP8 MMA's
narrower accumulator within a K block), and 200 repeated split-K calls bit-identical.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.triton_interp import case_result, child_main, module_results  # noqa: E402

# (name, kind, dtype, m, n, k, impl, bias, seed)
CASES = []
for _m, _n, _k, _s in ((1, 256, 512, 0), (3, 200, 300, 1), (16, 256, 384, 2), (96, 256, 384, 3), (65, 130, 200, 4)):
    CASES.append((f"fp8-m{_m}-n{_n}-k{_k}", "fp8", "bfloat16", _m, _n, _k, None, _s % 2 == 0, _s))
CASES += [("fp8-fp16-m3", "fp8", "float16", 3, 256, 256, None, True, 5),
          ("fp8-fp16-m80", "fp8", "float16", 80, 128, 256, None, False, 6),
          ("fp8-m33-n200-k384", "fp8", "bfloat16", 33, 200, 384, None, True, 7),
          ("fp8-weight-only-m100", "fp8", "bfloat16", 100, 200, 384, "weight_only", True, 19),
          ("fp8-w8a8-m3", "fp8", "bfloat16", 3, 256, 256, "triton", False, 8),
          ("fp8-split4-m2", "fp8", "bfloat16", 2, 64, 1024, None, True, 9),
          ("fp8-split4-m12", "fp8", "bfloat16", 12, 64, 1024, None, False, 21)]
for _m, _n, _k, _s in ((1, 256, 512, 10), (3, 200, 96, 11), (16, 256, 384, 12), (64, 128, 256, 13), (70, 64, 128, 14), (40, 64, 512, 20)):
    CASES.append((f"nvfp4-m{_m}-n{_n}-k{_k}", "nvfp4", "bfloat16", _m, _n, _k, None, _s % 2 == 0, _s))
CASES += [("nvfp4-fp16-m16", "nvfp4", "float16", 16, 128, 256, None, True, 15),
          ("nvfp4-ragged-k-m3", "nvfp4", "bfloat16", 3, 72, 200, "random", False, 16),
          ("nvfp4-ragged-k-m64", "nvfp4", "bfloat16", 64, 72, 200, "random", True, 17),
          ("nvfp4-split4-m5", "nvfp4", "bfloat16", 5, 64, 1024, "random", True, 18)]
# GEMV (qgemv.py) against float64 and the tl.dot path: (name, kind, dtype, m, n, k, index into the config
# table or None = the default dispatch, bias, seed); ragged N and K, every row count 1..9, both 16-bit dtypes
for _i, (_m, _n, _k, _c, _dt) in enumerate((
        (1, 200, 384, None, "bfloat16"), (2, 72, 1024, 0, "float16"), (3, 130, 640, 2, "bfloat16"),
        (4, 64, 200, 3, "float16"), (5, 96, 512, 4, "bfloat16"), (6, 40, 256, 6, "bfloat16"),
        (7, 136, 384, None, "float16"), (8, 64, 1024, 5, "bfloat16"), (9, 72, 320, None, "bfloat16"))):
    for _kind in ("fp8", "nvfp4"):
        CASES.append((f"{_kind}-gemv-m{_m}-n{_n}-k{_k}-c{_c}", f"{_kind}-gemv", _dt, _m, _n, _k, _c, _i % 2 == 1,
                      30 + 2 * _i + (_kind == "nvfp4")))
SPLIT_CASES = ("fp8-split4-m12", "fp8-split4-m2", "fp8-gemv-m2-n72-k1024-c0", "nvfp4-m40-n64-k512",
               "nvfp4-split4-m5", "nvfp4-gemv-m2-n72-k1024-c0")


def _ratio(y, ref, x, w, acc=2.0 ** -14):
    bound = 2.0 ** -7 * ref.abs() + acc * (x.double().abs() @ w.abs().t()) + 1e-30
    return float(((y.double() - ref).abs() / bound).max())


CT_N, CT_K = 256, 512  # one compressed-tensors checkpoint per process; cases use row/column slices


@functools.lru_cache(maxsize=1)
def _ct_nvfp4():
    """compressed-tensors' NVFP4A16 compression of a random [CT_N, CT_K] weight (rows of different
    magnitudes), and its decompressed weight."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    gen = torch.Generator().manual_seed(99)
    w = (torch.randn(CT_N, CT_K, generator=gen) * torch.rand(CT_N, 1, generator=gen)).to(torch.bfloat16)
    args = NVFP4A16["weights"]
    gs = generate_gparam(w.amin(), w.amax())
    grp = w.view(CT_N, CT_K // 16, 16)
    scale, _ = calculate_qparams(grp.amin(-1), grp.amax(-1), args, global_scale=gs)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
    dq = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
    return sd["weight_packed"], sd["weight_scale"], sd["weight_global_scale"], dq


def _fp8_case(name, dtype, m, n, k, impl, bias, gen):
    import triton
    from ninfer.kernels import fp8_gemm as F
    from ninfer.kernels.qgemv import GEMV_M
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), generator=gen) * 1e-2 + 1e-3
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = F.fp8_block_linear(x, w, s, b, impl=impl)
    wd = F.dequantize_ref(w, s)
    used = impl or ("gemv" if m <= GEMV_M["fp8"] else "weight_only" if m <= 64 else "triton")
    res = {"name": name, "shape_ok": list(y.shape) == [m, n] and y.dtype == dtype, "impl": used}
    if used in ("gemv", "weight_only"):
        ref = F.fp8_block_linear_ref(x, w, s, b)
        res["ratio"] = _ratio(y, ref, x, wd)
        # negative control: the scale of the next K block (a K-block index off by one)
        s_off = torch.roll(s, 1, dims=1) if s.shape[1] > 1 else torch.roll(s, 1, dims=0)
        res["ratio_wrong_scale"] = _ratio(F.fp8_block_linear_ref(x, w, s_off, b), ref, x, wd)
    else:
        q, qs = F.quantize_act(x)
        rq, rqs = F.quantize_act_ref(x)
        res["quant_exact"] = bool(torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(qs, rqs))
        xq = q.double() * qs.double().repeat_interleave(128, 1)[:, :k]
        ref = xq @ wd.t() + (b.double() if b is not None else 0)
        res["ratio"] = _ratio(y, ref, xq, wd)
        exact = F.fp8_block_linear_ref(x, w, s, b)
        res["rel_vs_unquantized"] = float((y.double() - exact).norm() / exact.norm())
    return res


def _nvfp4_case(name, dtype, m, n, k, kind, bias, gen):
    from ninfer.kernels import nvfp4_gemm as F
    x = torch.randn(m, k, generator=gen).to(dtype)
    res = {"name": name}
    if kind == "random":  # K not a multiple of 16: the last scale group is partial
        p = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        sc = (torch.rand(n, -(-k // 16), generator=gen) * 300 + 1).to(torch.float8_e4m3fn)
        gs = torch.tensor([700.0])
    else:
        p, sc, gs, dq = _ct_nvfp4()
        r0 = int(torch.randint(0, CT_N - n + 1, (1,), generator=gen))  # a row slice, the first k columns
        p, sc, dq = p[r0:r0 + n, :k // 2], sc[r0:r0 + n, :k // 16], dq[r0:r0 + n, :k]
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        ours = F.dequantize_ref(p, sc, gs)
        res["ct_unpack_exact"] = bool(torch.equal(unpack_fp4_from_uint8(p, n, k, torch.float32).double(),
                                                  F.unpack_e2m1_ref(p)))
        res["ct_decompress_rel"] = float(((dq.double() - ours).abs() / (ours.abs() + 1e-30)).max())
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = F.nvfp4_linear(x, p, sc, gs, b)
    wd = F.dequantize_ref(p, sc, gs)
    ref = F.nvfp4_linear_ref(x, p, sc, gs, b)
    res["shape_ok"] = list(y.shape) == [m, n] and y.dtype == dtype
    res["ratio"] = _ratio(y, ref, x, wd)
    swapped = ((p & 0xF) << 4) | (p >> 4)
    res["ratio_swapped_nibbles"] = _ratio(F.nvfp4_linear(x, swapped, sc, gs, b), ref, x, wd)
    return res


def _gemv_case(name, kind, dtype, m, n, k, cfg_index, bias, gen):
    """The GEMV against float64 (bound as above), against the tl.dot path (both within their bound
    of the same reference: within 2 bounds of each other), and with a scale one block off in K read
    by the kernel itself (must break the bound); NVFP4 also with swapped nibbles."""
    import triton
    from ninfer.kernels import fp8_gemm, nvfp4_gemm, qgemv
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    table = qgemv.FP8_CONFIGS if kind == "fp8-gemv" else qgemv.NVFP4_CONFIGS
    cfg = None if cfg_index is None else table[cfg_index]
    if kind == "fp8-gemv":
        w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), generator=gen) * 1e-2 + 1e-3
        wargs, F, gemv, old = (w, s), fp8_gemm, qgemv.fp8_gemv, "weight_only"
        wrong = [(w, torch.roll(s, 1, dims=1))]
    else:
        p = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        sc = (torch.rand(n, -(-k // 16), generator=gen) * 300 + 1).to(torch.float8_e4m3fn)
        gs = torch.tensor([700.0])
        wargs, F, gemv, old = (p, sc, gs), nvfp4_gemm, qgemv.nvfp4_gemv, "dot"
        wrong = [(p, torch.roll(sc, 1, dims=1), gs), (((p & 0xF) << 4) | (p >> 4), sc, gs)]
    lin = fp8_gemm.fp8_block_linear if kind == "fp8-gemv" else nvfp4_gemm.nvfp4_linear
    y = lin(x, *wargs, b) if cfg is None else gemv(x, *wargs, b, dtype, cfg)
    wd = F.dequantize_ref(*wargs)
    ref = x.double() @ wd.t() + (b.double() if b is not None else 0)
    res = {"name": name, "shape_ok": list(y.shape) == [m, n] and y.dtype == dtype, "impl": "gemv",
           "cfg": list(cfg or qgemv.candidates(kind.split("-")[0], triton.next_power_of_2(m))[0])}
    res["ratio"] = _ratio(y, ref, x, wd)
    res["ratio_vs_dot"] = _ratio(y, lin(x, *wargs, b, impl=old).double(), x, wd) / 2
    res["ratio_wrong"] = min(_ratio(gemv(x, *wa, b, dtype, cfg) if cfg else lin(x, *wa, b), ref, x, wd)
                             for wa in wrong)
    return res


def _split(res, kind, m, n, k, cfg):
    """The K splits the small-M path of a case ran with (the same plan the launch computes)."""
    import triton
    from ninfer.kernels import qgemv
    from ninfer.kernels.qgemm_common import row_tile, split_k
    cpu = torch.device("cpu")
    if res.get("impl") == "gemv":
        cfg = tuple(cfg or qgemv.candidates(kind.split("-")[0], triton.next_power_of_2(m))[0])
        return qgemv.plan(cfg, cpu, n, k)[0]
    # the tl.dot kernels: 64 columns, K blocks of 128
    return split_k(cpu, -(-n // 64) * -(-m // row_tile(m)), -(-k // 128))[0]


def run_case(name, kind, dtype, m, n, k, impl, bias, seed):
    torch.set_num_threads(1)  # tiny shapes: intra-op threads only spin (tests/conftest.py)
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    from ninfer.kernels.qgemm_common import _COUNTERS
    from ninfer.kernels.qgemv import GEMV_M
    if kind.endswith("gemv"):
        res = _gemv_case(name, kind, dt, m, n, k, impl, bias, gen)
    else:
        res = (_fp8_case if kind == "fp8" else _nvfp4_case)(name, dt, m, n, k, impl, bias, gen)
        res.setdefault("impl", "gemv" if m <= GEMV_M["nvfp4"] else "dot")
    if m <= 64 and impl != "triton":
        res["split"] = _split(res, kind, m, n, k, res.get("cfg"))
    res["counters_zero"] = all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())
    return res


results = module_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_qgemm_case(results, case):
    r = case_result(results, case[0])
    assert r["shape_ok"]
    assert r["ratio"] <= 1.0, r
    assert r["counters_zero"], r  # split-K tickets are left zeroed for the next launch
    if case[0] in SPLIT_CASES:
        assert r["split"] >= 2, r
    if "ratio_wrong_scale" in r:
        assert r["ratio_wrong_scale"] > 10.0, r
    if "ratio_swapped_nibbles" in r:
        assert r["ratio_swapped_nibbles"] > 10.0, r
    if "ratio_vs_dot" in r:  # the GEMV: agrees with the tl.dot path; a wrong scale or nibble order breaks it
        assert r["ratio_vs_dot"] <= 1.0, r
        assert r["ratio_wrong"] > 10.0, r
    if "quant_exact" in r:
        assert r["quant_exact"], r
        assert r["rel_vs_unquantized"] < 0.06, r
    if "ct_unpack_exact" in r:
        assert r["ct_unpack_exact"], r
        assert r["ct_decompress_rel"] <= 2.0 ** -8, r  # compressed-tensors rounds its result to bf16


def test_bad_inputs_one_line():
    from ninfer.kernels.fp8_gemm import fp8_block_linear
    from ninfer.kernels.nvfp4_gemm import nvfp4_linear
    from ninfer.kernels.qgemv import row_bucket
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    w8 = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale_inv must be float32 \[1, 2\]"):
        fp8_block_linear(x, w8, torch.ones(1, 1))
    with pytest.raises(ValueError, match="x's last dim must be K=256"):
        fp8_block_linear(x[:, :128], w8, torch.ones(1, 2))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        fp8_block_linear(x.float(), w8, torch.ones(1, 2))
    with pytest.raises(ValueError, match="impl must be one of"):
        fp8_block_linear(x, w8, torch.ones(1, 2), impl="fast")
    p = torch.zeros(64, 128, dtype=torch.uint8)
    sc = torch.ones(64, 16).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale must be float8_e4m3fn \[64, 16\]"):
        nvfp4_linear(x, p, sc[:, :8], torch.tensor(1.0))
    with pytest.raises(ValueError, match="impl must be one of"):
        nvfp4_linear(x, p, sc, torch.tensor(1.0), impl="mma")
    with pytest.raises(ValueError, match="take 1..32 rows"):  # impl="gemv" at M = 33
        row_bucket(33)
    with pytest.raises(ValueError, match="float32 scalar"):
        nvfp4_linear(x, p, sc, torch.ones(2))
    with pytest.raises(ValueError, match=r"bias must be \[N=64\]"):
        nvfp4_linear(x, p, sc, torch.tensor(1.0), torch.zeros(65))
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            nvfp4_linear(x, p, sc, torch.tensor(1.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_bench_gemm_needs_cuda(capsys):
    from ninfer.cli import main
    assert main(["bench", "gemm", "--m", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("kind,bm,idx", (("fp8", 1, 0), ("fp8", 8, 1), ("nvfp4", 1, 0), ("nvfp4", 8, 1)))
def test_gemv_sm90_code(kind, bm, idx):
    """The GEMV compiled for sm90 here (no GPU needed): nothing as large as its weight tile is converted
    between layouts (a conversion goes through shared memory; only x, the scales and the per-row result
    may be, a small fraction of the tile at these configs); the weight comes by 16-byte
    (FP8) / 8-byte (NVFP4) loads, or cp.async copies of that size when pipelined."""
    import math
    import re

    import triton
    from ninfer.kernels import qgemv
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("the kernels are interpreted in this process")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this Triton has no sm90 compiler API: {e}")
    bn, bk, warps, _, stages = cfg = qgemv.candidates(kind, bm)[idx]
    if kind == "fp8":
        fn, sig = qgemv._fp8_gemv_kernel, "*bf16 i32 *fp8e4nv *fp32 i32 *bf16 *bf16 *fp32 *i32 i32 i32 i32 i32"
    else:
        fn = qgemv._nvfp4_gemv_kernel
        sig = "*bf16 i32 *u8 i32 *fp8e4nv i32 *fp32 *bf16 *bf16 *fp32 *i32 i32 i32 i32 i32"
    consts = dict(HAS_BIAS=True, DIRECT=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages)
    types = dict(zip(fn.arg_names, sig.split()), **{c: "constexpr" for c in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if types[a].startswith("*") or a in ("sxm", "K", "K_PER_SPLIT", "swn", "ssn")}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=types, constexprs=consts, attrs=aligned),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    except (RuntimeError, FileNotFoundError, OSError) as e:  # no ptxas here
        pytest.skip(f"no sm90 compiler: {type(e).__name__}: {str(e)[:200]}")
    converted = re.findall(r"ttg\.convert_layout %\S+ : tensor<([0-9x]+)x[a-zA-Z]", k.asm["ttgir"])
    tile = bn * bk // (1 if kind == "fp8" else 2)  # the weight tile's elements (NVFP4: bytes)
    assert converted and all(math.prod(int(d) for d in c.split("x")) < tile for c in converted), (cfg, converted)
    if stages > 1:
        vec = r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], " + ("0x10" if kind == "fp8" else "0x8")
    else:
        vec = r"ld\.global\.v4\.b32" if kind == "fp8" else r"ld\.global\.v2\.b32"
    assert re.search(vec, k.asm["ptx"]), (cfg, vec)


def test_bench_gemm_crossover():
    """The bench's summary names, per format and shape, the M at which each weight-only path won;
    rows without a time (errors, untimed) are left out."""
    from ninfer.bench.gemm import crossover
    t = {("fp8-gemv", 1): 10.0, ("fp8-weight-only", 1): 20.0, ("fp8-gemv", 16): 30.0, ("fp8-weight-only", 16): 20.0,
         ("nvfp4-gemv", 4): 5.0, ("nvfp4-dot", 4): 9.0}
    rows = [{"impl": i, "shape": "qkv", "m": m, "us": us} for (i, m), us in t.items()]
    rows += [{"impl": "fp8-gemv", "shape": "qkv", "m": 64, "error": "the GEMV takes M <= 32"},
             {"impl": "fp8-weight-only", "shape": "qkv", "m": 64, "us": 40.0}]
    assert crossover(rows) == ["# fp8 qkv: GEMV faster at M = [1], tl.dot at M = [16]",
                               "# nvfp4 qkv: GEMV faster at M = [4], tl.dot at M = []"]


# -- GPU, at Qwen3-8B's shapes (K, N): qkv, down ---------------------------------------------------
GPU_SHAPES = ((4096, 6144), (12288, 4096))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("m", (1, 8, 16, 64, 4096))
@pytest.mark.parametrize("kn", GPU_SHAPES, ids=lambda kn: f"k{kn[0]}-n{kn[1]}")
def test_fp8_cuda(m, kn):
    """Every FP8 path on the GPU against float64. W8A8 on Hopper: the FP8 MMA accumulates a 128-wide
    K block with fewer than fp32's bits before the fp32 promotion, hence a 2^-10 accumulation term."""
    from ninfer.kernels import fp8_gemm as F
    k, n = kn
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn((m, k), device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn((n, k), device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand((n // 128, k // 128), device="cuda", generator=gen) * 4e-4 + 1e-4
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    wd = F.dequantize_ref(w, s)
    ref = F.fp8_block_linear_ref(x, w, s, b)
    assert _ratio(F.fp8_block_linear(x, w, s, b, impl="weight_only"), ref, x, wd) <= 1.0
    if m <= 32:  # qgemv.MAX_M
        assert _ratio(F.fp8_block_linear(x, w, s, b, impl="gemv"), ref, x, wd) <= 1.0
    q, qs = F.quantize_act(x)
    rq, rqs = F.quantize_act_ref(x)
    # On the H200 the codes were not bit-equal to torch's cast (the interpreter's are, see above), so
    # here each code must be a nearest-or-next e4m3 point of x / s: within one step (2^-3 relative,
    # 2^-9 absolute below the normal range) of x, with scales within an ulp of the reference.
    assert torch.allclose(qs, rqs, rtol=2.0 ** -23, atol=0)
    xs = x.double() / qs.double().repeat_interleave(128, 1)[:, :k]
    assert ((q.double()[:, :k] - xs).abs() <= xs.abs() * 2.0 ** -3 + 2.0 ** -9).all()
    xq = q.double() * qs.double().repeat_interleave(128, 1)
    qref = xq @ wd.t()
    assert _ratio(F.fp8_block_linear(x, w, s, b, impl="triton"), qref + b.double(), xq, wd, acc=2.0 ** -10) <= 1.0
    if F.scaled_mm_supported(n, k):  # without bias: scaled_mm's bias is a second bf16 rounding
        try:
            y = F.fp8_block_linear(x, w, s, impl="scaled_mm")
        except (RuntimeError, ValueError):  # cuBLAS without blockwise fp8: prefill_impl never picks it
            y = None
        assert y is None or _ratio(y, qref, xq, wd, acc=2.0 ** -10) <= 1.0
    assert F.prefill_impl(x.device) in ("triton", "scaled_mm")
    y = F.fp8_block_linear(x, w, s, b)
    assert float((y.double() - ref).norm() / ref.norm()) < (1e-2 if m <= 64 else 6e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("m", (1, 8, 16, 64, 4096))
@pytest.mark.parametrize("kn", GPU_SHAPES, ids=lambda kn: f"k{kn[0]}-n{kn[1]}")
def test_nvfp4_cuda(m, kn):
    from ninfer.kernels import nvfp4_gemm as F
    k, n = kn
    gen = torch.Generator(device="cuda").manual_seed(m + k + 1)
    x = torch.randn((m, k), device="cuda", generator=gen).to(torch.bfloat16)
    p = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    sc = (torch.rand((n, k // 16), device="cuda", generator=gen) * 200 + 8).to(torch.float8_e4m3fn)
    gs = torch.tensor([2688.0 / 0.1], device="cuda")
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = F.nvfp4_linear_ref(x, p, sc, gs, b)
    wd = F.dequantize_ref(p, sc, gs)
    for impl in (None, "dot") + (("gemv",) if m <= 32 else ()):  # qgemv.MAX_M
        assert _ratio(F.nvfp4_linear(x, p, sc, gs, b, impl=impl), ref, x, wd) <= 1.0, impl


@pytest.mark.cuda
@needs_cuda
def test_split_k_cuda_deterministic():
    """The decode GEMMs sum their K splits in the kernel (the last split to finish reads the others'
    partials): repeated calls are bit-identical, and the ticket counters are left at zero. A
    missing ordering between the partial stores and the ticket shows as a differing run."""
    from ninfer.kernels.fp8_gemm import fp8_block_linear
    from ninfer.kernels.nvfp4_gemm import nvfp4_linear
    from ninfer.kernels import qgemv
    from ninfer.kernels.qgemm_common import counters, split_k
    gen = torch.Generator(device="cuda").manual_seed(7)
    k, n = 12288, 4096
    assert split_k(torch.device("cuda"), n // 64, k // 128)[0] > 1
    x = torch.randn((4, k), device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn((n, k), device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand((n // 128, k // 128), device="cuda", generator=gen) * 4e-4 + 1e-4
    p = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    sc = (torch.rand((n, k // 16), device="cuda", generator=gen) * 200 + 8).to(torch.float8_e4m3fn)
    gs = torch.tensor([2688.0 / 0.1], device="cuda")
    rows = qgemv.GEMV_M
    for fn in (lambda: fp8_block_linear(x[:rows["fp8"]], w, s), lambda: nvfp4_linear(x[:rows["nvfp4"]], p, sc, gs),
               lambda: fp8_block_linear(x, w, s, impl="weight_only"), lambda: nvfp4_linear(x, p, sc, gs, impl="dot")):
        first = fn()
        outs = [fn() for _ in range(200)]
        assert all(torch.equal(o, first) for o in outs)
    assert int(counters(x.device).abs().sum()) == 0
    for kind in ("fp8", "nvfp4"):  # the GEMVs (their most rows) ran, and the configs the timing chose split K
        cfg = qgemv.chosen(kind, x.device, rows[kind], n, k)
        assert cfg is not None and qgemv.plan(cfg, x.device, n, k)[0] > 1, kind


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(child_main(CASES, run_case))
