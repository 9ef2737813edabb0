"""The attention layer: q/k/v projections (one merged matmul), optional per-head q/k RMSNorm (before
RoPE), RoPE, key centring (when installed), then the attention backend (which stores K/V in the paged
cache and attends), then o_proj. On CUDA the q/k norm, RoPE and key centring run as one Triton
kernel (ninfer/kernels/qk_norm_rope.py).

Tensor parallel: the head counts given are the model's; each rank computes num_heads / N query
heads and num_kv_heads / N KV heads (q|k|v column-parallel by heads, o_proj row-parallel), so the
backend and the KV pool of a rank see only its heads."""
from __future__ import annotations

import torch
from torch import nn

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.distributed import parallel_state as ps
from ninfer.layers import fused
from ninfer.layers.linear import MergedLinear, RowParallelLinear
from ninfer.layers.norm import RMSNorm
from ninfer.layers.rotary import apply_rotary

qk_norm_rope = fused.lazy_kernel("ninfer.kernels.qk_norm_rope", "qk_norm_rope")


class Attention(nn.Module):
    """`kv_layer` is the layer's index among the layers that hold KV (the pool's layer index)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, kv_layer: int,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, eps: float) -> None:
        super().__init__()
        size = ps.tp_size()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads // size, num_kv_heads // size, head_dim
        self.kv_layer = kv_layer
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.qkv_proj = MergedLinear(hidden, (("q_proj", num_heads * head_dim), ("k_proj", num_kv_heads * head_dim),
                                              ("v_proj", num_kv_heads * head_dim)), qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.key_transform = None  # exact key centring/smoothing before the cache (kvcache/centering.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                backend: BaseAttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        tf = self.key_transform
        if fused.use_fused_kernels(q):  # q/k stay strided views of the qkv output; one launch for both
            norm = self.q_norm is not None
            q, k = qk_norm_rope(q, k, cos, sin, self.q_norm.weight if norm else None,
                                self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0,
                                **(tf.fused_args() if tf is not None else {}))
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if tf is not None:
                q, k = tf(q, k)
        out = backend.forward(self.kv_layer, q, k, v, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))
