"""Rotation helpers for the kernels: the format's R = S.H64.S (``ninfer/kvcache/hadamard.py``),
built in registers from indices: sign of R[i, j] = parity(i & j) ^ f(i) ^ f(j), entries +-1/8.

The rotated 4-bit formats store group g's coordinate ``64g + 8j + w`` as nibble j of word w
(docs/ARCHITECTURE.md "4-bit data layout"). Unpacking a page tile word by word therefore yields
the rotated coordinates in *word order*: element ``e = 8w + j`` of a 64-group is coordinate
``perm(e) = 8 * (e % 8) + e // 8``. Instead of permuting the big K/V tiles back, the kernels rotate
Q with ``M = R[:, perm]`` (scores are unchanged: ``(qM)(kM)^T = q k^T`` since M is orthonormal)
and undo the output with ``M^T``; the permutation costs nothing that way.

Why inside the kernel and not a torch matmul: Q enters once per program and the output leaves
once, so two [rows * D/64, 64] x [64, 64] dots on tensor cores (exact +-1/8 operands) are free
next to the page loop, while a separate torch pass would write and re-read Q and a float32
output buffer through HBM per layer. The torch twins below are the test oracle.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ninfer.kvcache.hadamard import rotation_matrix


@functools.lru_cache(maxsize=None)
def _perm() -> torch.Tensor:
    e = torch.arange(64)
    return 8 * (e % 8) + e // 8


def word_order_rotation(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """M [64, 64] with ``M[i, e] = R[i, perm(e)]``: natural-order x -> rotated, word-ordered x @ M."""
    return rotation_matrix(torch.float64)[:, _perm()].to(dtype=dtype, device=device)


def to_word_domain(x: torch.Tensor) -> torch.Tensor:
    """[..., D] natural order -> rotated word-ordered coordinates (float32)."""
    d = x.shape[-1]
    xg = x.to(torch.float32).reshape(*x.shape[:-1], d // 64, 64)
    return (xg @ word_order_rotation(device=x.device)).reshape(x.shape)


def from_word_domain(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_word_domain` (float32)."""
    d = y.shape[-1]
    yg = y.to(torch.float32).reshape(*y.shape[:-1], d // 64, 64)
    return (yg @ word_order_rotation(device=y.device).T).reshape(y.shape)


@triton.jit
def _parity(p):
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return p & 1


@triton.jit
def rot_entry(i, j):
    """R[i, j] for broadcastable int32 index tensors in [0, 64)."""
    fi = _parity((i & (i >> 1)) & 0x15)  # the format's bent sign function f
    fj = _parity((j & (j >> 1)) & 0x15)
    return tl.where((_parity(i & j) ^ fi ^ fj) == 1, -0.125, 0.125)


@triton.jit
def rot64(DTYPE: tl.constexpr):
    """R as a [64, 64] tile (symmetric, so also R^T)."""
    return rot_entry(tl.arange(0, 64)[:, None], tl.arange(0, 64)[None, :]).to(DTYPE)


@triton.jit
def rot64_word_order(TRANSPOSED: tl.constexpr, DTYPE: tl.constexpr):
    """M (or M^T when TRANSPOSED) as a [64, 64] tile of DTYPE."""
    a = tl.arange(0, 64)[:, None]
    b = tl.arange(0, 64)[None, :]
    if TRANSPOSED:
        r = rot_entry(8 * (a % 8) + a // 8, b)  # rows e, columns i
    else:
        r = rot_entry(a, 8 * (b % 8) + b // 8)  # rows i, columns e
    return r.to(DTYPE)


@triton.jit
def _sign64():
    """s_i = (-1)^f(i) of the format as a [64] float32 vector."""
    i = tl.arange(0, 64)
    return tl.where(_parity((i & (i >> 1)) & 0x15) == 1, -1.0, 1.0)


@triton.jit
def rotate_rows_fwht(x):
    """x [BT, 64] float32 -> x @ R, R = S.H64.S, by the 6-stage Walsh-Hadamard butterfly
    (6 x 64 adds per row instead of a 64 x 64 product). Each stage pairs index bit 0, writes the
    (sum, difference) pair bit as the new top bit (an index rotation), so after 6 stages the order is
    natural again. Exact whenever the 64-term +-1/8 sums are exact in float32 (every intermediate is
    a signed partial sum of the same terms), hence equal to torch's matmul in that case."""
    BT: tl.constexpr = x.shape[0]
    s = _sign64()[None, :]
    y = x * s
    for _ in tl.static_range(6):
        a, b = tl.split(tl.reshape(y, (BT, 32, 2)))
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (BT, 64))
    return y * (s * 0.125)
