"""FP8 block-scaled linear for HF fine-grained FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 layout):
``weight[N, K]`` float8_e4m3fn with ``weight_scale_inv[ceil(N/128), ceil(K/128)]`` fp32, dequantized
``w[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]``.

Three paths, by the number of rows M:
* M <= qgemv.GEMV_M["fp8"] (decode): the weight-only GEMV of qgemv.py (no tl.dot; W read once for all rows).
* M <= 64 (decode batches): weight-only on the MMA (``impl="weight_only"``). Bound by the weight
  bytes, so the fp8 weight is converted to the activation dtype in registers (exact: e4m3 has 4
  significant bits) and multiplied on the 16-bit MMA; the block scale is applied per 128-column K
  block in fp32. K is split over programs so a decode-sized grid still keeps every SM reading;
  partials are summed in a fixed order.
* M > 64 (prefill): W8A8. x is quantized per token per 128-column group to e4m3 (scale = amax/448,
  a small kernel), then an FP8 tensor-core GEMM multiplies both scales into the fp32 accumulator
  per K block. On sm90 torch's ``scaled_mm`` with BlockWise1x128 x BlockWise128x128 scales (cuBLAS)
  does the same GEMM; ``prefill_impl`` times both once per device and keeps the faster.
GPUs without FP8 tensor cores (before sm89) run the weight-only kernels at every M.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels import qgemv
from ninfer.kernels.qgemm_common import (SMALL_M, check_common, check_device, epilogue, interpreting, row_tile,
                                         sm_count, split_buffers, split_k)

BLOCK = 128  # the checkpoint's scale block, both dims
FP8_MAX = 448.0
_PREFILL_IMPL: dict[int, str] = {}  # device index -> "triton" | "scaled_mm", chosen on first use


@triton.jit
def _round_e4m3(v):
    """v rounded to nearest-even on the e4m3 grid, in fp32, so the cast after it is exact (the
    interpreter's fp32 -> e4m3 cast drops the carry of a round-up into the exponent: 124.3 -> 64)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # 3 mantissa bits, ties to even
    normal = bits.to(tl.float32, bitcast=True)
    sub = (v * 512.0 + 12582912.0) - 12582912.0  # below 2^-6: multiples of 2^-9 (1.5 * 2^23 rounds)
    r = tl.where(tl.abs(v) < 0.015625, sub * 0.001953125, normal)
    return tl.minimum(tl.maximum(r, -448.0), 448.0)


@triton.jit
def _mma(a, b, INTERPRET: tl.constexpr):
    """a @ b in fp32; the interpreter's 16-bit dot works on raw bit patterns, so there the same
    (exactly converted) operands go in as fp32."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _act_quant_kernel(x_ptr, sxm, q_ptr, s_ptr, ssm, ssg, M, K, ROWS: tl.constexpr):
    """Rows r0 .. r0+ROWS of K group g: q = x / s as e4m3 (round to nearest), s = amax / 448."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    k = g * 128 + tl.arange(0, 128)
    mr = r < M
    mask = mr[:, None] & (k < K)[None, :]
    r64 = r.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * sxm + k[None, :], mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (Triton's `/` is approximate on GPUs): the same scales and codes as torch's
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10), tl.full((ROWS,), 448.0, tl.float32))
    q = _round_e4m3(tl.math.div_rn(x, tl.broadcast_to(s[:, None], (ROWS, 128)))).to(tl.float8e4nv)
    tl.store(q_ptr + r64 * K + k[None, :], q, mask=mask)
    tl.store(s_ptr + r * ssm + g * ssg, s, mask=mr)


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, sasm, sasg, b_ptr, bs_ptr, sbsn, bias_ptr, c_ptr, M, N, K,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """C = sum over K blocks of (A_q B_q^T) * a_scale[m, kb] * b_scale[n // 128, kb]; A_q [M, K] and
    B_q [N, K] e4m3 row-major, BLOCK_K = 128 (one scale per operand row per K block)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)  # row-grouped order: a group of M tiles shares B tiles in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    mm = rm < M
    mn = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * K
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        k = kb * 128 + rk
        mk = k < K
        a = tl.load(a_rows + k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        sa = tl.load(as_ptr + rm * sasm + kb * sasg, mask=mm, other=0.0)
        sb = tl.load(bs_ptr + (rn // 128) * sbsn + kb, mask=mn, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@triton.jit
def _weight_only_kernel(x_ptr, sxm, w_ptr, ws_ptr, swsn, bias_ptr, o_ptr, p_ptr, cnt_ptr, M, N, K,
                        KB_PER_SPLIT, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """x @ dequant(w)^T over this split's K blocks (qgemm_common.epilogue sums the splits); e4m3 ->
    x dtype is exact, the block scale multiplies each K block's fp32 product."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    mm = rm < M
    mn = rn < N
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb0 = pid_s * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, tl.cdiv(K, 128))
    for kb in range(kb0, kb1):
        k = kb * 128 + rk
        mk = k < K
        x = tl.load(x_rows + k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=mk[:, None] & mn[None, :], other=0.0).to(DT)
        s = tl.load(ws_ptr + (rn // 128) * swsn + kb, mask=mn, other=0.0)
        acc += _mma(x, w, INTERPRET) * s[None, :]
    epilogue(acc, o_ptr, p_ptr, cnt_ptr, bias_ptr, rm, rn, M, N, pid_m * tl.num_programs(0) + pid_n, pid_s,
             tl.num_programs(1), HAS_BIAS, DIRECT)


def _check(x, weight, wsi, bias):
    op = "fp8_block_linear"
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{op}: weight must be a 2-D float8_e4m3fn [N, K], got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    want = (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
    if wsi.dtype != torch.float32 or tuple(wsi.shape) != want:
        raise ValueError(f"{op}: weight_scale_inv must be float32 {list(want)} for weight {[n, k]}, "
                         f"got {wsi.dtype} {list(wsi.shape)}")
    x2 = check_common(op, x, n, k, bias)
    check_device(op, x, weight, wsi)
    return x2, weight.contiguous(), wsi.contiguous()


def quantize_act(x: torch.Tensor, *, scale_col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit, unit stride along K) -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]), one
    scale per token per 128 columns. ``scale_col_major`` stores the scales K-block-major (the layout
    cuBLAS's blockwise scaled_mm reads: strides (1, M)) and returns the [M, G] view."""
    m, k = x.shape
    g = triton.cdiv(k, BLOCK)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scale_col_major:
        s = torch.empty((g, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m:
        rows = 16
        _act_quant_kernel[(triton.cdiv(m, rows), g)](x, x.stride(0), q, s, s.stride(0), s.stride(1), m, k,
                                                     ROWS=rows, num_warps=4)
    return q, s


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``quantize_act``: same scale, x / s rounded to e4m3 by torch."""
    m, k = x.shape
    g = triton.cdiv(k, BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, g * BLOCK - k)).view(m, g, BLOCK)
    s = xf.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
    q = (xf / s[..., None]).to(torch.float8_e4m3fn).view(m, g * BLOCK)[:, :k]
    return q, s


def dequantize_ref(weight: torch.Tensor, wsi: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """w[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128] in ``dtype``."""
    n, k = weight.shape
    s = wsi.to(dtype).repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return weight.to(dtype) * s


def fp8_block_linear_ref(x, weight, weight_scale_inv, bias=None) -> torch.Tensor:
    """float64 x @ dequant(weight)^T + bias (the exact product of what the checkpoint means)."""
    y = x.to(torch.float64) @ dequantize_ref(weight, weight_scale_inv).t()
    return y + bias.to(torch.float64) if bias is not None else y


def _fp8_tensor_cores(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _w8a8_triton(x2, weight, wsi, bias, out_dtype):
    m, k = x2.shape
    n = weight.shape[0]
    q, s = quantize_act(x2)
    out = torch.empty((m, n), dtype=out_dtype, device=x2.device)
    # 128 x 128 tiles for long prefills; below, 64-row tiles (and 64 columns while there are fewer
    # tiles than SMs) so a mid-sized M still spreads over the GPU
    bm, warps = (128, 8) if m > 512 else (64, 4)
    bn = 64 if triton.cdiv(m, bm) * triton.cdiv(n, 128) < sm_count(x2.device) else 128
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _w8a8_kernel[grid](q, s, s.stride(0), s.stride(1), weight, wsi, wsi.stride(0),
                       bias if bias is not None else out, out, m, n, k, HAS_BIAS=bias is not None,
                       BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=warps, num_stages=3)
    return out


def scaled_mm_supported(n: int, k: int) -> bool:
    """Shapes cuBLAS's blockwise scaled_mm takes here: whole 128 blocks, and the weight scales
    (read K-block-major, [K/128, N/128] with strides (1, K/128)) with 16-byte aligned columns."""
    return hasattr(torch.nn.functional, "scaled_mm") and n % BLOCK == 0 and k % (4 * BLOCK) == 0


def _w8a8_scaled_mm(x2, weight, wsi, bias, out_dtype):
    from torch.nn.functional import ScalingType, scaled_mm
    q, s = quantize_act(x2, scale_col_major=True)
    y = scaled_mm(q, weight.t(), s, ScalingType.BlockWise1x128, wsi.t(), ScalingType.BlockWise128x128,
                  output_dtype=out_dtype)
    return y + bias.to(out_dtype) if bias is not None else y  # a second rounding, unlike the Triton paths


def _weight_only(x2, weight, wsi, bias, out_dtype):
    m, k = x2.shape
    n = weight.shape[0]
    bm = row_tile(m)
    bn = 64
    kblocks = triton.cdiv(k, BLOCK)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    split, per = split_k(x2.device, tiles, kblocks)
    out, partial, cnt = split_buffers(m, n, split, tiles, out_dtype, x2.device)
    _weight_only_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, bm))](
        x2, x2.stride(0), weight, wsi, wsi.stride(0), bias if bias is not None else out, out, partial, cnt,
        m, n, k, per, HAS_BIAS=bias is not None, DIRECT=split == 1, BLOCK_M=bm, BLOCK_N=bn,
        INTERPRET=interpreting(), num_warps=4, num_stages=3)
    return out


IMPLS = {"gemv": qgemv.fp8_gemv, "weight_only": _weight_only, "triton": _w8a8_triton,
         "scaled_mm": _w8a8_scaled_mm}


def prefill_impl(device: torch.device, n: int = 4096, k: int = 4096) -> str:
    """The W8A8 GEMM of a device, chosen once: cuBLAS's blockwise scaled_mm when it runs, agrees
    with the Triton kernel and is faster at a 2048 x 4096 x 4096 GEMM; otherwise the Triton kernel."""
    if device.type != "cuda":
        return "triton"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _PREFILL_IMPL:
        return _PREFILL_IMPL[idx]
    if torch.cuda.is_current_stream_capturing() or not scaled_mm_supported(n, k):
        return "triton"  # decided later, outside a graph capture
    choice = "triton"
    try:
        from ninfer.bench.kernel_timing import median_us
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((2048, k), device=device, generator=g).to(torch.bfloat16)
        w = torch.randn((n, k), device=device, generator=g).to(torch.float8_e4m3fn)
        s = torch.rand((n // BLOCK, k // BLOCK), device=device, generator=g) * 1e-2 + 1e-3
        a, b = _w8a8_triton(x, w, s, None, x.dtype).float(), _w8a8_scaled_mm(x, w, s, None, x.dtype).float()
        if ((a - b).norm() / a.norm()).item() < 1e-2:
            no_flush = lambda: None  # noqa: E731  (a compute-bound GEMM: the L2 does not matter)
            t_tr = median_us(lambda: _w8a8_triton(x, w, s, None, x.dtype), 30, flush=no_flush)
            t_sm = median_us(lambda: _w8a8_scaled_mm(x, w, s, None, x.dtype), 30, flush=no_flush)
            choice = "scaled_mm" if t_sm < t_tr else "triton"
    except (RuntimeError, ValueError):  # cuBLAS without blockwise fp8 (CUDA < 12.9): the Triton kernel
        choice = "triton"
    _PREFILL_IMPL[idx] = choice
    return choice


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None, *, impl: str | None = None) -> torch.Tensor:
    """x [..., K] bf16/fp16 @ dequant(weight)^T (+ bias) -> [..., N] in x's dtype. ``impl`` forces a
    path ("gemv", "weight_only", "triton", "scaled_mm"); by default M <= qgemv.GEMV_M["fp8"] is the GEMV,
    M <= 64 weight-only (tl.dot), larger M W8A8."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"fp8_block_linear: impl must be one of {sorted(IMPLS)}, got {impl!r}")
    x2, weight, wsi = _check(x, weight, weight_scale_inv, bias)
    m, n = x2.shape[0], weight.shape[0]
    if impl is None:
        if m <= qgemv.GEMV_M["fp8"]:
            impl = "gemv"
        elif m <= SMALL_M or not _fp8_tensor_cores(x2.device):
            impl = "weight_only"
        else:
            impl = prefill_impl(x2.device)
            if impl == "scaled_mm" and (x.dtype != torch.bfloat16 or not scaled_mm_supported(n, x2.shape[1])):
                impl = "triton"  # chosen for bf16 at whole blocks
    out = IMPLS[impl](x2, weight, wsi, bias, x.dtype) if m else x2.new_empty((0, n))
    return out.reshape(*x.shape[:-1], n)
