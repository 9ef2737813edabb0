"""Building blocks of the decoder: RMSNorm, merged linears (q|k|v and gate|up run as one matmul;
the loader fills their row blocks from the checkpoint's separate tensors), the SwiGLU MLP and the
attention layer that hands q/k/v to the attention backend. Tensors are flattened over the step's
tokens: [T, ...]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.models.rope import apply_rotary


class RMSNorm(nn.Module):
    """Normalizes in float32, casts back, then multiplies by the weight (transformers' order, which
    matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class MergedLinear(nn.Linear):
    """One linear whose output rows are the concatenation of several checkpoint linears.
    `parts` = ((checkpoint module name, rows), ...), in row order."""

    def __init__(self, in_features: int, parts: tuple[tuple[str, int], ...], bias: bool) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=bias)
        self.parts = parts

    def part_rows(self) -> dict[str, tuple[int, int]]:
        """checkpoint module name -> (first row, rows)."""
        out, start = {}, 0
        for name, n in self.parts:
            out[name] = (start, n)
            start += n
        return out


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        self.intermediate = intermediate
        self.gate_up_proj = MergedLinear(hidden, (("gate_proj", intermediate), ("up_proj", intermediate)), bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm (Qwen3, before RoPE), RoPE, then the backend
    (which stores K/V in the paged cache and attends), then o_proj."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, kv_layer: int,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kv_layer = kv_layer  # index among the layers that hold KV (the pool's layer index)
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = MergedLinear(
            hidden, (("q_proj", self.q_size), ("k_proj", self.kv_size), ("v_proj", self.kv_size)), qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(self.kv_layer, q, k, v, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))
