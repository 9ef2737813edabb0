"""E8 lattice codec and 4-bit nibble layout: the bit-exact specification GPU kernels follow.

Everything here works on *code units* z = x / s (x rotated, s the represented fp16 scale of
the 64-group, see ``formats.py``), vectorised over any leading shape; no Python loop touches
tokens.

Lattice and box (DESIGN 2.1 step 3)
-----------------------------------
E8 = D8 u (D8 + 1/2). Inside the box every point is ``p = n + c/2`` with ``n`` in [-8, 7]^8,
``sum(n)`` even and the coset bit ``c`` in {0, 1}: integer points in [-8, 7], half-integer
points in [-7.5, 7.5]. So both cosets are the same problem "nearest n in [-8,7]^8 with even
sum" applied to ``y = z`` (c = 0) and to ``y = z - 0.5`` (c = 1).

Nearest point, exactly as computed (float32 throughout, IEEE round-to-nearest ops):

1. ``f = clamp(rint(y), -8, 7)`` per coordinate (``rint`` = round half to even), ``r = y - f``.
2. Next-nearest in-box value of the other parity: ``a = f + t`` with ``t = +1 if r >= 0 else -1``;
   if that leaves the box (f = 7 with t = +1, or f = -8 with t = -1) use the inward neighbour,
   ``t = -t``. Moving coordinate i costs ``(y-a)^2 - (y-f)^2 = 1 - 2*r_i*t_i``, so the cheapest
   move is the coordinate with the largest key ``m_i = r_i * t_i`` (an exact product);
   **ties go to the lowest block position j** (nibble index, see layout).
3. If ``sum(f)`` is odd, ``n = f`` with ``n_i += t_i`` for that one coordinate, else ``n = f``.
   Changing one coordinate by its cheapest other-parity value is optimal for a separable cost
   with a parity constraint, so ``n`` is the exact nearest even-sum point of the box.
4. ``d_c = sum_j (y_j - n_j)^2`` summed **sequentially j = 0..7** in float32, for y0 = z and
   y1 = z - 0.5 (one float32 subtraction). ``c = 1`` iff ``d_1 < d_0`` (**ties keep the integer
   coset**). For inputs whose arithmetic is exact (dyadic values, e.g. every tie case) the result
   does not depend on the summation order.

The float32 decisions can differ from real arithmetic only when two candidates are equidistant
to within float32 rounding; the tests bound the gap to the exact nearest point by 1e-5.

4-bit layout (docs/ARCHITECTURE.md "4-bit data layout")
-------------------------------------------------------
Per (token, head), group g (64 rotated coordinates) owns bytes [32g, 32g+32) = 8 little-endian
uint32 words. Word w holds coordinates ``64g + 8j + w`` for j = 0..7, nibble j in bits
[4j, 4j+4): byte ``32g + 4w + b`` has coordinate ``64g + 16b + w`` in its low nibble and
``64g + 16b + 8 + w`` in its high nibble. One word is one E8 block; nibble position j of the 8
words of a group is the 8 contiguous coordinates 64g+8j .. 64g+8j+7.
Nibbles are offset binary ``u = n + 8``. rk4v4-e8 replaces the low bit of nibble 7 (bit 28 of
the word) by the coset bit c; n7's true low bit is the parity of n0..n6 (sum(n) is even).
Decode: ``c = u7 & 1``, ``u7 = (u7 & 0xE) | parity(u0..u6)``, ``p = (u - 8) + c/2``.
"""
from __future__ import annotations

import torch

GROUP = 64
NMIN, NMAX = -8, 7


# ----------------------------------------------------------------------------- layout
def to_blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D/64, 8 (word w), 8 (nibble j)]: element (g, w, j) is coordinate 64g+8j+w."""
    d = x.shape[-1]
    if d % GROUP != 0:
        raise ValueError(f"4-bit layout needs head_dim to be a multiple of {GROUP}, got {d}")
    return x.reshape(*x.shape[:-1], d // GROUP, 8, 8).transpose(-1, -2)


def from_blocks(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: [..., G, 8 (w), 8 (j)] -> [..., 64G]."""
    g = b.shape[-3]
    return b.transpose(-1, -2).reshape(*b.shape[:-3], g * GROUP)


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """Offset-binary nibbles u in [0, 15], laid out [..., G, 8 (w), 8 (j)] -> uint8 [..., 32G]."""
    u = u.to(torch.uint8)
    byte = u[..., 0::2] | (u[..., 1::2] << 4)  # [..., G, w, b]: byte b of word w (little endian)
    return byte.reshape(*u.shape[:-3], u.shape[-3] * 32)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32G] -> nibbles int32 [..., G, 8 (w), 8 (j)]."""
    if data.dtype != torch.uint8:
        raise ValueError(f"packed 4-bit data must be uint8, got {data.dtype}")
    if data.shape[-1] % 32 != 0:
        raise ValueError(f"packed 4-bit extent must be a multiple of 32 bytes, got {data.shape[-1]}")
    b = data.reshape(*data.shape[:-1], data.shape[-1] // 32, 8, 4).to(torch.int32)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 8)


# ----------------------------------------------------------------------------- E8 nearest point
def _nearest_even_in_box(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest n in [-8,7]^8 with even sum to y (float32 [..., 8]). Returns (n int32, distance^2)."""
    f = torch.round(y).clamp_(NMIN, NMAX)
    r = y - f
    t = torch.where(r >= 0, 1.0, -1.0)
    t = torch.where((f + t > NMAX) | (f + t < NMIN), -t, t)  # at the box edge: the inward neighbour
    key = r * t
    fi = f.to(torch.int32)
    odd = (fi.sum(dim=-1) & 1).bool()
    j = torch.argmax(key, dim=-1, keepdim=True)  # first maximum = lowest position on ties
    move = torch.zeros_like(fi).scatter_(-1, j, 1) * odd[..., None].to(torch.int32)
    n = fi + move * t.to(torch.int32)
    e = y - n.to(y.dtype)
    sq = e * e
    d = sq[..., 0]
    for k in range(1, 8):  # fixed sequential order: part of the bit-exact specification
        d = d + sq[..., k]
    return n, d


def e8_nearest(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest point of E8 in the box to each 8-vector z [..., 8] (any float, computed in float32).

    Returns (n int32 [..., 8] in [-8, 7] with even sum, c int32 [...] in {0, 1}); the point is
    p = n + c/2.
    """
    if z.shape[-1] != 8:
        raise ValueError(f"E8 blocks are 8-dimensional, got last dim {z.shape[-1]}")
    z = z.to(torch.float32)
    n0, d0 = _nearest_even_in_box(z)
    n1, d1 = _nearest_even_in_box(z - 0.5)
    half = d1 < d0  # ties keep the integer coset
    n = torch.where(half[..., None], n1, n0)
    return n, half.to(torch.int32)


def e8_point(n: torch.Tensor, c: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """p = n + c/2 (exact in any float dtype)."""
    return n.to(dtype) + 0.5 * c.to(dtype)[..., None]


# ----------------------------------------------------------------------------- codecs on [..., D]
def encode_e8(z: torch.Tensor) -> torch.Tensor:
    """Code units z [..., D] (D % 64 == 0) -> packed rk4v4-e8 data uint8 [..., D/2]."""
    n, c = e8_nearest(to_blocks(z))
    u = n + 8
    u[..., 7] = (u[..., 7] & 0xE) | c  # coset bit replaces n7's redundant low bit
    return pack_nibbles(u)


def decode_e8_blocks(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rk4v4-e8 data -> (n int32 [..., G, 8 (w), 8 (j)], c int32 [..., G, 8 (w)])."""
    u = unpack_nibbles(data)
    c = u[..., 7] & 1
    par = u[..., :7].sum(dim=-1) & 1
    u = u.clone()
    u[..., 7] = (u[..., 7] & 0xE) | par
    return u - 8, c


def decode_e8(data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rk4v4-e8 data uint8 [..., D/2] -> lattice points p (code units) [..., D]."""
    n, c = decode_e8_blocks(data)
    return from_blocks(e8_point(n, c, dtype))


def encode_scalar4(z: torch.Tensor) -> torch.Tensor:
    """rk4v4: n = clamp(rint(z), -8, 7) per coordinate, same nibble layout, no coset bit."""
    n = torch.round(z.to(torch.float32)).clamp_(NMIN, NMAX).to(torch.int32)
    return pack_nibbles(to_blocks(n) + 8)


def decode_scalar4(data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rk4v4 data uint8 [..., D/2] -> integer code values n [..., D]."""
    return from_blocks(unpack_nibbles(data) - 8).to(dtype)
