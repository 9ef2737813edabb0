"""SiLU(gate) * up over a [T, 2I] gate|up tensor; on CUDA the Triton kernel of
ninfer/kernels/silu_mul.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.layers import fused

silu_mul = fused.lazy_kernel("ninfer.kernels.silu_mul", "silu_mul")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if fused.use_fused_kernels(gate_up):
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
