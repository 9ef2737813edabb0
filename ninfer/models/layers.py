"""Building blocks of the decoder: RMSNorm, merged linears (q|k|v and gate|up run as one matmul;
the loader fills their row blocks from the checkpoint's separate tensors), the SwiGLU MLP and the
attention layer that hands q/k/v to the attention backend. Tensors are flattened over the step's
tokens: [T, ...].

On CUDA (`use_fused_kernels`) the elementwise work runs in Triton kernels (ninfer/kernels/
rmsnorm.py, qk_norm_rope.py, silu_mul.py) that round like these torch ops, and the decoder carries
the residual stream between layers (`DecoderLayer.forward_residual`) so every residual add is fused
into the next RMSNorm: per layer 4 small kernels instead of ~50. Elsewhere (the CPU, where the
transformers-parity tests run) the torch code below runs unchanged."""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.models.rope import apply_rotary


def _kernel(module: str, name: str):
    """A fused-op kernel imported on its first call: Triton is an optional install where they never
    run (a CPU-only machine), so importing the model must not need it."""
    fn = None

    def call(*args, **kwargs):
        nonlocal fn
        if fn is None:
            fn = getattr(importlib.import_module(module), name)
        return fn(*args, **kwargs)
    call.__name__ = name
    return call


rmsnorm = _kernel("ninfer.kernels.rmsnorm", "rmsnorm")
fused_add_rmsnorm = _kernel("ninfer.kernels.rmsnorm", "fused_add_rmsnorm")
qk_norm_rope = _kernel("ninfer.kernels.qk_norm_rope", "qk_norm_rope")
silu_mul = _kernel("ninfer.kernels.silu_mul", "silu_mul")


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton fused-op kernels run for tensors like x: on CUDA, for inference (they
    record no autograd graph). Tests patch this to run them on the CPU under TRITON_INTERPRET=1."""
    return x.is_cuda and not x.requires_grad


class RMSNorm(nn.Module):
    """Normalizes in float32, casts back, then multiplies by the weight (transformers' order, which
    matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the sum is rounded to the dtype as `residual + x` is."""
        if use_fused_kernels(x):
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual


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
        gate_up = self.gate_up_proj(x)
        if use_fused_kernels(gate_up):
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
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
        if use_fused_kernels(q):  # q/k stay strided views of the qkv output; one launch for both
            norm = self.q_norm is not None
            q, k = qk_norm_rope(q, k, cos, sin, self.q_norm.weight if norm else None,
                                self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0)
        else:
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

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                         sin: torch.Tensor, meta: AttentionMetadata,
                         backend: BaseAttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the residual stream carried separately: the previous layer's MLP output x
        and the stream before it (None at the first layer, where x is the stream) -> this layer's
        MLP output and stream. Each add happens inside the next norm, rounded like `h + ...`, so
        summing the last pair reproduces `forward`'s h bit for bit."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_add(x, residual)
        x, residual = self.post_attention_layernorm.forward_add(self.self_attn(x, cos, sin, meta, backend), residual)
        return self.mlp(x), residual
