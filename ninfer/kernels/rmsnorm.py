"""RMSNorm and fused residual-add + RMSNorm: one Triton program per row, and their torch references.

Numerics follow ``ninfer/layers/norm.py`` RMSNorm (transformers' order), op by op, every value
held in float32 and rounded to the tensor dtype exactly where a torch op in that dtype rounds:

    s   = residual + x                  (fused variant; rounded to x.dtype, as torch's bf16 add)
    n   = s.float() * rsqrt(mean(s.float()^2) + eps)   -> rounded to x.dtype
    out = weight * n                    (one rounding of the float32 product to the promoted
                                         dtype, as torch's op; exact product for 16-bit operands)

The only freedom left is the summation order of ``mean``: torch's CPU and CUDA reductions each
use their own tree, so the float32 mean can differ in its last bit and, rarely, n by one ulp of
its dtype (out then by up to two, after the weight multiply). Everything else mirrors the torch
op of the tensor's device (``CUDA`` flag):
CUDA's mean is ``sum * (1/N)`` and its rsqrt is libdevice's ``rsqrtf``; the CPU's mean is
``sum / N``. No FMA contraction (``enable_fp_fusion=False``): every product is rounded like
torch's separate kernels round it.

``round_to`` is shared with the other fused-op kernels (qk_norm_rope.py, silu_mul.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x -> float32 holding x rounded to nearest-even in DTYPE (what a torch op that
    computes in float32 and returns DTYPE gives). bf16 rounds by integer arithmetic on the bits:
    the interpreter's own float32->bf16 cast truncates, and this way both paths share one rule.
    The later store's cast to DTYPE is then exact everywhere."""
    if DTYPE == tl.bfloat16:
        u = x.to(tl.int32, bitcast=True)
        # RNE at bit 16 (a carry out of the mantissa bumps the exponent: rounds up to inf where due);
        # only NaN bit patterns can wrap, and they are restored below
        u = tl.add(u, 0x7FFF + ((u >> 16) & 1), sanitize_overflow=False) & -65536
        return tl.where(x != x, x, u.to(tl.float32, bitcast=True))  # NaN stays NaN
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)  # cvt.rn on GPU, numpy's RNE in the interpreter
    else:
        return x


@triton.jit
def row_rstd(xf, N: tl.constexpr, eps, CUDA: tl.constexpr):
    """rsqrt(mean(xf^2) + eps) over the last axis of float32 rows (masked lanes hold 0), as torch on
    the device; the reduced axis is dropped."""
    ss = tl.sum(xf * xf, axis=len(xf.shape) - 1)
    if CUDA:
        # torch's CUDA mean multiplies by the float reciprocal; rsqrt is libdevice's rsqrtf
        return libdevice.rsqrt(ss * (1.0 / N) + eps)
    else:
        ms = tl.math.div_rn(ss, tl.full(ss.shape, N, tl.float32))  # the CPU's mean divides
        return tl.rsqrt(ms + eps)


@triton.jit
def _rmsnorm_kernel(x_ptr, sxa, sxb, sxn, r_ptr, sra, srb, srn, w_ptr, o_ptr, ro_ptr, B, eps,
                    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, CUDA: tl.constexpr):
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    row = a * B + b  # row of the contiguous outputs
    cols = tl.arange(0, BLOCK)
    m = cols < N
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + a * sxa + b * sxb + cols * sxn, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + a * sra + b * srb + cols * srn, mask=m, other=0.0).to(tl.float32)
        x = round_to(r + x, DT)
        tl.store(ro_ptr + row * N + cols, x, mask=m)
    n = round_to(x * row_rstd(x, N, eps, CUDA), DT)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * N + cols, round_to(n * w, o_ptr.dtype.element_ty), mask=m)


def num_warps_for(block: int) -> int:
    return max(1, min(16, block // 512))


def _as3d(x: torch.Tensor) -> torch.Tensor:
    """[N] / [T, N] / [T, H, N] -> a 3-D view (strides kept)."""
    while x.dim() < 3:
        x = x.unsqueeze(1) if x.dim() == 2 else x.unsqueeze(0)
    return x


def check_out(out: torch.Tensor | None, shape, dtype: torch.dtype, device, op: str, name: str) -> torch.Tensor:
    """A given output buffer (contiguous, exact shape/dtype/device), or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"{op}: {name} must be a contiguous {dtype}{list(shape)} on {device}, "
                         f"got {out.dtype}{list(out.shape)} on {out.device} (contiguous={out.is_contiguous()})")
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: x/weight must be fp16/bf16/fp32, got {x.dtype}/{weight.dtype}")
    if x.dim() not in (1, 2, 3):
        raise ValueError(f"{op}: x must be [N], [T, N] or [T, H, N], got {list(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight {list(weight.shape)} must be [N] for x {list(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"{op}: x and weight must be on one device ({x.device} vs {weight.device})")


def _launch(x, res, weight, eps, out, res_out) -> None:
    x3 = _as3d(x)
    r3 = x3 if res is None else _as3d(res)
    a, b, n = x3.shape
    if x.numel() == 0:
        return
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(a, b)](
        x3, x3.stride(0), x3.stride(1), x3.stride(2), r3, r3.stride(0), r3.stride(1), r3.stride(2),
        weight if weight.is_contiguous() else weight.contiguous(), out, out if res_out is None else res_out,
        b, float(eps), N=n, BLOCK=block, HAS_RES=res is not None, CUDA=x.is_cuda,
        num_warps=num_warps_for(block), enable_fp_fusion=False)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [N], [T, N] or [T, H, N] (any strides, e.g. per-head views);
    returns a contiguous tensor of x's shape in torch's promoted dtype of (x, weight)."""
    _check(x, weight, "rmsnorm")
    out = check_out(out, x.shape, torch.promote_types(x.dtype, weight.dtype), x.device, "rmsnorm", "out")
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                      out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x), residual + x) in one pass. ``residual_out`` may be ``residual``
    itself (each program reads its whole row before writing it)."""
    _check(x, weight, "fused_add_rmsnorm")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"fused_add_rmsnorm: residual {residual.dtype}{list(residual.shape)} must match "
                         f"x {x.dtype}{list(x.shape)} on {x.device}")
    out = check_out(out, x.shape, torch.promote_types(x.dtype, weight.dtype), x.device, "fused_add_rmsnorm", "out")
    residual_out = check_out(residual_out, x.shape, x.dtype, x.device, "fused_add_rmsnorm", "residual_out")
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (ninfer/layers/norm.py), verbatim."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rmsnorm_ref(residual, weight, eps), residual
