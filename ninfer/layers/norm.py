"""RMSNorm in transformers' rounding order, with the residual add fused in (`forward_add`); on CUDA
both run in the Triton kernels of ninfer/kernels/rmsnorm.py."""
from __future__ import annotations

import torch
from torch import nn

from ninfer.layers import fused

rmsnorm = fused.lazy_kernel("ninfer.kernels.rmsnorm", "rmsnorm")
fused_add_rmsnorm = fused.lazy_kernel("ninfer.kernels.rmsnorm", "fused_add_rmsnorm")


class RMSNorm(nn.Module):
    """Normalizes in float32, casts back, then multiplies by the weight (transformers' order, which
    matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.use_fused_kernels(x):
            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the sum is rounded to the dtype as `residual + x` is."""
        if fused.use_fused_kernels(x):
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual


class OffsetRMSNorm(nn.Module):
    """RMSNorm with weight stored as an offset from 1 (Qwen3.5 / Qwen3-Next): the product is taken
    in float32, `x_hat * (1 + w)`, and only then rounded (transformers' order for these models)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
