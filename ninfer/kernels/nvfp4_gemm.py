"""NVFP4 weight-only linear for compressed-tensors ``nvfp4-pack-quantized`` checkpoints:
``weight_packed[N, K/2]`` uint8 holds two e2m1 codes per byte (LOW nibble = even column; bit 3 =
sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), ``weight_scale[N, K/16]`` float8_e4m3fn per 16 columns,
``weight_global_scale`` a float32 scalar: ``w = e2m1 * float(weight_scale) / weight_global_scale``.

Hopper has no FP4 tensor cores, so the weight is dequantized in registers and multiplied on the
16-bit MMA. ``e2m1 * scale`` is exact in bf16 and fp16 (2 x 4 significant bits, magnitudes 2^-10 ..
2688), so the only roundings are the MMA's fp32 accumulation and the output; the global scale
divides the fp32 accumulator once. Up to qgemv.GEMV_M["nvfp4"] rows (decode) the GEMV of qgemv.py runs
instead (no MMA: fp32 FMAs, the packed bytes read once for all rows). With the MMA (``impl="dot"``):
up to 64 rows one 16..64-row tile per program and K split over programs, so a decode-sized grid
keeps every SM reading the packed bytes; larger M runs 128-row tiles, each dequantized weight tile
reused by all of them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels import qgemv
from ninfer.kernels.qgemm_common import (SMALL_M, check_common, check_device, epilogue, interpreting, row_tile,
                                         split_buffers, split_k)

GROUP = 16  # columns per weight_scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@triton.jit
def _e2m1(code):
    """4-bit codes (uint16) -> fp32 values: e2m1 s.ee.m -> fp16 s.000ee.m000000000, then x 2^14 (the
    exponent biases 15 vs 1; code 1 lands on the fp16 subnormal 2^-15 -> 0.5)."""
    return (((code & 8) << 12) | ((code & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _nvfp4_kernel(x_ptr, sxm, w_ptr, swn, s_ptr, ssn, gs_ptr, bias_ptr, o_ptr, p_ptr, cnt_ptr, M, N, K,
                  KB_PER_SPLIT, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """x @ dequant(w)^T over this split's K blocks (qgemm_common.epilogue sums the splits). The
    packed bytes are read as they lie (BLOCK_K/2 contiguous bytes per output column, viewed as
    [groups of 16 columns, 8 bytes]); their low nibbles (even columns) and high nibbles (odd
    columns) are two [BLOCK_K/2, BLOCK_N] operands, multiplied by x's even and odd columns (x's
    tile split in registers)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    NG: tl.constexpr = BLOCK_K // 16
    rg = tl.arange(0, NG)
    rb = rg[:, None, None] * 8 + tl.arange(0, 8)[None, :, None]  # [NG, 8, 1] byte within the tile
    mm = rm < M
    mn = rn < N
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sxm
    w_cols = w_ptr + rn.to(tl.int64)[None, None, :] * swn
    s_cols = s_ptr + rn.to(tl.int64)[None, :] * ssn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb0 = pid_s * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    for kb in range(kb0, kb1):
        k = kb * BLOCK_K + rk
        x = tl.load(x_rows + k[None, :], mask=mm[:, None] & (k < K)[None, :], other=0.0)
        xe, xo = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        b = kb * (BLOCK_K // 2) + rb
        byte = tl.load(w_cols + b, mask=(b < K // 2) & mn[None, None, :], other=0).to(tl.uint16)
        g = kb * NG + rg
        sc = tl.load(s_cols + g[:, None], mask=(g * 16 < K)[:, None] & mn[None, :], other=0.0).to(tl.float32)
        sc = sc[:, None, :]
        lo = tl.reshape((_e2m1(byte & 0xF) * sc).to(DT), (BLOCK_K // 2, BLOCK_N))
        hi = tl.reshape((_e2m1(byte >> 4) * sc).to(DT), (BLOCK_K // 2, BLOCK_N))
        if INTERPRET:  # the interpreter's 16-bit dot works on raw bit patterns: same values in fp32
            acc += tl.dot(xe.to(tl.float32), lo.to(tl.float32)) + tl.dot(xo.to(tl.float32), hi.to(tl.float32))
        else:
            acc = tl.dot(xe, lo, acc)
            acc = tl.dot(xo, hi, acc)
    acc = acc * (1.0 / tl.load(gs_ptr))
    epilogue(acc, o_ptr, p_ptr, cnt_ptr, bias_ptr, rm, rn, M, N, pid_m * tl.num_programs(0) + pid_n, pid_s,
             tl.num_programs(1), HAS_BIAS, DIRECT)


def _check(x, packed, scale, gs, bias):
    op = "nvfp4_linear"
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"{op}: weight_packed must be a 2-D uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    want = (n, triton.cdiv(k, GROUP))
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != want:
        raise ValueError(f"{op}: weight_scale must be float8_e4m3fn {list(want)} for weight_packed "
                         f"{list(packed.shape)}, got {scale.dtype} {list(scale.shape)}")
    if gs.numel() != 1 or gs.dtype != torch.float32:
        raise ValueError(f"{op}: weight_global_scale must be a float32 scalar, got {gs.dtype} {list(gs.shape)}")
    x2 = check_common(op, x, n, k, bias)
    check_device(op, x, packed, scale, gs)
    return x2, packed.contiguous(), scale.contiguous(), gs.reshape(1)


IMPLS = ("gemv", "dot")


def nvfp4_linear(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_global_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                 impl: str | None = None) -> torch.Tensor:
    """x [..., K] bf16/fp16 @ dequant(weight)^T (+ bias) -> [..., N] in x's dtype. ``impl`` forces a
    path ("gemv", "dot"); by default M <= qgemv.GEMV_M["nvfp4"] is the GEMV, larger M the tl.dot kernel."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"nvfp4_linear: impl must be one of {list(IMPLS)}, got {impl!r}")
    x2, packed, scale, gs = _check(x, weight_packed, weight_scale, weight_global_scale, bias)
    m, k = x2.shape
    n = packed.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], n))
    if impl == "gemv" or (impl is None and m <= qgemv.GEMV_M["nvfp4"]):
        return qgemv.nvfp4_gemv(x2, packed, scale, gs, bias, x.dtype).reshape(*x.shape[:-1], n)
    if m <= SMALL_M:
        bm, bn, bk, warps = row_tile(m), 64, 128, 4
        split, per = split_k(x2.device, triton.cdiv(n, bn), triton.cdiv(k, bk))
    else:
        bm, bn, bk, warps = (128, 128, 64, 8) if m > 64 else (64, 128, 64, 4)
        split, per = 1, triton.cdiv(k, bk)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    out, partial, cnt = split_buffers(m, n, split, tiles, x.dtype, x2.device)
    _nvfp4_kernel[(triton.cdiv(n, bn), split, triton.cdiv(m, bm))](
        x2, x2.stride(0), packed, packed.stride(0), scale, scale.stride(0), gs, bias if bias is not None else out,
        out, partial, cnt, m, n, k, per, HAS_BIAS=bias is not None, DIRECT=split == 1, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, INTERPRET=interpreting(), num_warps=warps, num_stages=3)
    return out.reshape(*x.shape[:-1], n)


def unpack_e2m1_ref(packed: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] e2m1 values: low nibble first, bit 3 the sign."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    mag = torch.tensor(E2M1, dtype=dtype, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def dequantize_ref(packed, scale, global_scale, dtype=torch.float64) -> torch.Tensor:
    """w = e2m1 * float(weight_scale) / weight_global_scale, in ``dtype``."""
    vals = unpack_e2m1_ref(packed, dtype)
    s = scale.to(dtype).repeat_interleave(GROUP, 1)[:, :vals.shape[1]]
    return vals * s / global_scale.to(dtype).reshape(())


def nvfp4_linear_ref(x, weight_packed, weight_scale, weight_global_scale, bias=None) -> torch.Tensor:
    """float64 x @ dequant(weight)^T + bias."""
    y = x.to(torch.float64) @ dequantize_ref(weight_packed, weight_scale, weight_global_scale).t()
    return y + bias.to(torch.float64) if bias is not None else y
