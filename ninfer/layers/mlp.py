"""The SwiGLU MLP: one gate|up matmul, SiLU-and-multiply, down_proj. Tensor parallel: gate|up
column-parallel (each rank intermediate / N columns of both), down_proj row-parallel."""
from __future__ import annotations

import torch
from torch import nn

from ninfer.distributed import parallel_state as ps
from ninfer.layers.activation import silu_and_mul
from ninfer.layers.linear import MergedLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        self.intermediate = intermediate // ps.tp_size()
        self.gate_up_proj = MergedLinear(hidden, (("gate_proj", intermediate), ("up_proj", intermediate)), bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
