"""SwiGLU activation: gate_up [T, 2I] (gate | up halves, the merged gate_up_proj output) -> silu(gate) * up
[T, I], one launch instead of torch's split + silu + mul.

Rounding as torch's two ops in the tensor dtype: ``F.silu`` computes ``g / (1 + exp(-g))`` in
float32 and rounds to the dtype, then ``* up`` multiplies two dtype values (exact in float32) and
rounds again. On CUDA the kernel uses what torch's CUDA silu uses -- libdevice ``expf`` and an
IEEE division (``div_rn``; Triton's ``/`` is approximate) -- so the float32 silu agrees to the
bit; the interpreter uses numpy's exp, which may differ from torch's CPU exp in the last bit of
float32 (a bf16/fp16 result then differs by at most one ulp, rarely).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ninfer.kernels.rmsnorm import FLOAT_DTYPES, check_out, round_to

BLOCK = 512  # outputs per program: Qwen3-8B's I = 12288 gives 24 programs per token


@triton.jit
def _silu_mul_kernel(x_ptr, sxt, sxi, o_ptr, I, BLOCK: tl.constexpr, CUDA: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < I
    DT: tl.constexpr = x_ptr.dtype.element_ty
    row = x_ptr + t * sxt
    g = tl.load(row + j * sxi, mask=m, other=0.0).to(tl.float32)
    u = tl.load(row + (j + I) * sxi, mask=m, other=0.0).to(tl.float32)
    if CUDA:
        e = libdevice.exp(-g)  # expf, as torch's CUDA silu (tl.exp is ex2.approx-based)
    else:
        e = tl.exp(-g)
    s = round_to(tl.math.div_rn(g, 1.0 + e), DT)
    tl.store(o_ptr + t * I + j, round_to(s * u, DT), mask=m)


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2I] (any strides); contiguous [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [T, 2I], got {list(gate_up.shape)}")
    if gate_up.dtype not in FLOAT_DTYPES:
        raise ValueError(f"silu_mul: dtype must be fp16/bf16/fp32, got {gate_up.dtype}")
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = check_out(out, (t, i), gate_up.dtype, gate_up.device, "silu_mul", "out")
    if t == 0 or i == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(i))
    _silu_mul_kernel[(t, triton.cdiv(i, block))](
        gate_up, gate_up.stride(0), gate_up.stride(1), out, i, BLOCK=block, CUDA=gate_up.is_cuda,
        num_warps=4 if block >= 512 else 1, enable_fp_fusion=False)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The model's torch path (ninfer/layers/activation.py silu_and_mul)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
