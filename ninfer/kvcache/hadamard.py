"""Rotation of the rotated KV formats (DESIGN 2.1 step 1): R = S . H64 . S per 64-group.

H64[i, j] = (-1)^popcount(i & j) / 8 is the orthonormal Sylvester Hadamard matrix (natural order).
S = diag(s) is a fixed sign pattern, part of the format:

    s_i = (-1)^f(i),  f(i) = parity((i & (i >> 1)) & 0b010101) = b0*b1 ^ b2*b3 ^ b4*b5

(b_k the bits of the position i in 0..63). f is a *bent* function: the Walsh spectrum of s is
flat, so H64 maps the constant vector (a DC offset), and every other Hadamard row times s, to a
vector with all entries +-1 instead of one spike. R[i, j] = s_i * s_j * H64[i, j] is still +-1/8,
symmetric and orthonormal, hence its own inverse (``rotate(rotate(x)) == x``) and
``rotate(q) . rotate(k) == q . k``. Kernels use R exactly like H64: sign of R[i, j] =
parity(popcount(i & j)) ^ f(i) ^ f(j).

Why the signs (measured with the rk4v4-e8 codec, 5 draws of [1024, 128] each, dB):
N(0,1) 20.92 both ways; 4 outlier channels x30: 24.40 vs 24.39; heavy (bench data b) 25.04 vs
25.03; but offsets shared by all tokens that are constant over runs of channels (DC, halves,
runs of 2..32 channels, the structure Sylvester rows have) drop plain H64 to 11.7-19.4 dB while
S.H.S keeps 21.1-24.5 dB (a random sign pattern: 19.9-21.4 dB). Nothing measured got worse.

Arithmetic: float32 (float64 inputs stay float64); lower-precision inputs are upcast first.
GPU kernels sum in another order, so their rotated values may differ from these in the last ulp;
the quantizer is bit-exact given the same rotated input (see ``e8.py``).
"""
from __future__ import annotations

import functools

import torch

GROUP = 64


@functools.lru_cache(maxsize=None)
def _h64_cpu(dtype: torch.dtype) -> torch.Tensor:
    idx = torch.arange(GROUP)
    bits = idx[:, None] & idx[None, :]
    # popcount via the six bit positions; parity decides the sign.
    pop = torch.zeros_like(bits)
    for b in range(6):
        pop += (bits >> b) & 1
    sign = 1.0 - 2.0 * (pop & 1).to(torch.float64)
    return (sign / 8.0).to(dtype)


def h64(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 64x64 orthonormal Sylvester Hadamard matrix (entries +-1/8, exact in any float dtype)."""
    return _h64_cpu(dtype).to(device=device, copy=True)


def sign_pattern(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fixed +-1 pattern s (length 64) of the format, from the bent function f above."""
    i = torch.arange(GROUP)
    v = (i & (i >> 1)) & 0x15
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return (1.0 - 2.0 * (v & 1).to(torch.float64)).to(dtype)


@functools.lru_cache(maxsize=None)
def _rot_cpu(dtype: torch.dtype) -> torch.Tensor:
    s = sign_pattern(torch.float64)
    return (s[:, None] * _h64_cpu(torch.float64) * s[None, :]).to(dtype)


def rotation_matrix(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """R = S . H64 . S (64x64, entries +-1/8, symmetric, R @ R = I): the matrix of :func:`rotate`."""
    return _rot_cpu(dtype).to(device=device, copy=True)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Apply R = S.H64.S to every 64-group of the last dim (a multiple of 64). Self-inverse."""
    d = x.shape[-1]
    if d % GROUP != 0:
        raise ValueError(f"H64 rotation needs the last dim to be a multiple of {GROUP}, got {d}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xg = x.to(dt).reshape(*x.shape[:-1], d // GROUP, GROUP)
    return (xg @ _rot_cpu(dt).to(x.device)).reshape(*x.shape[:-1], d)


inverse_rotate = rotate  # R is symmetric and orthonormal
