"""E8 lattice codec and 4-bit nibble layout: the bit-exact specification GPU kernels follow.

Everything here works on *code units* z = x * RN(1/s) (x rotated, s the represented fp16 scale
of the 64-group, see ``formats/base.py``; for rk4v4-e8 rounded to the grid ``GRID``), vectorised over
any leading shape; no Python loop touches tokens.

Lattice and box (DESIGN 2.1 step 3)
-----------------------------------
E8 = D8 u (D8 + 1/2). Inside the box every point is ``p = n + c/2`` with ``n`` in [-8, 7]^8,
``sum(n)`` even and the coset bit ``c`` in {0, 1}: integer points in [-8, 7], half-integer
points in [-7.5, 7.5]. So both cosets are the same problem "nearest n in [-8,7]^8 with even
sum" applied to ``y = z`` (c = 0) and to ``y = z - 0.5`` (c = 1), solved together below.

Nearest point, exactly as computed (float32 IEEE round-to-nearest ops; one rint per coordinate
serves both cosets, so a kernel pays for one search, not two):

1. ``f = clamp(rint(z), -8, 7)`` (``rint`` = round half to even), ``r = z - f`` (exact) and
   ``a = min(|r|, z + 8)``: the distance ``|z - f|``, negated below the box (z < -8).
2. The half coset's nearest in-box values are ``n1 = f - m``, ``m = [r < 0 and a > 0]`` (the
   half-integer below z where z is below f, else above), at distance ``|0.5 - a|`` in every case,
   so its squared distance exceeds the integer coset's by exactly ``sum(0.25 - a) = 2 - S`` with
   ``S = a_0 + ... + a_7`` **summed sequentially**. No squares are computed.
3. Moving one coordinate to its next-nearest in-box value of the other parity costs ``1 - 2k``:
   ``k0 = min(a, 7 - z)`` in the integer coset and ``k1 = 0.5 - v``, ``v = max(a, -7 - z)`` in the
   half coset (both are the distance to the current value, negated where the move must turn
   inward at the box edge). If a coset's sum is odd, the coordinate with the largest key moves
   (the integer coset: up unless r < 0; the half coset: up iff m; inward at the edge);
   **ties go to the lowest block position j**. Changing one coordinate by its cheapest
   other-parity value is optimal for a separable cost with a parity constraint.
4. With ``P0 = 1 - 2 max k0`` and ``P1 = 1 - 2 (0.5 - min v)`` where that coset's sum is odd (else
   0), ``c = 1`` iff ``(2 - S) + P1 < P0`` (**ties keep the integer coset**).

The float32 decisions can differ from real arithmetic only when two candidates are equidistant
to within float32 rounding; the tests bound the gap to the exact nearest point by 1e-5. Kernels
may drop the lower clamp and the ``z + 8`` term of step 1 (so ``a = |r|``, ``m = [r < 0]``): they
change nothing for z >= -8, and the 4-bit scale rounds up, so code units lie in [-8, 8]
(``formats/base.py``).

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
# rk4v4-e8 code units are x * y rounded once to this grid (formats.code_units). In [-8, 8] every
# grid value is an fp16, and every quantity of the search (r, a, keys, S, the coset decision) is
# exact in fp16 too, so a kernel searches two words per half2 instruction and still finds the
# exact nearest point of the rounded z. The rounding moves z by at most 2^-9 (a lattice point is
# ~0.3 away on average; docs/ARCHITECTURE.md "The rk4v4-e8 codec (fixed format)").
GRID = 2.0 ** -8


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
def coset_candidates(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both cosets' nearest even-sum points for z float32 [..., 8] (steps 1-4 above).

    Returns (n0, n1, half): int32 [..., 8] each in [-8, 7] with an even sum (the point is n0, or
    n1 + 1/2) and bool [...] (the half coset is the nearer)."""
    f = torch.round(z).clamp_(NMIN, NMAX)
    r = z - f
    a = torch.minimum(r.abs(), z + 8.0)
    k0 = torch.minimum(a, 7.0 - z)
    v = torch.maximum(a, -7.0 - z)
    s = a[..., 0]
    for j in range(1, 8):  # fixed sequential order: part of the bit-exact specification
        s = s + a[..., j]
    m = ((r < 0) & (a > 0)).to(torch.int32)
    n0 = f.to(torch.int32)
    n1 = n0 - m
    odd0 = (n0.sum(-1) & 1).bool()
    odd1 = (n1.sum(-1) & 1).bool()
    p0 = torch.where(odd0, 1.0 - 2.0 * k0.amax(-1), 0.0)
    p1 = torch.where(odd1, 1.0 - 2.0 * (0.5 - v.amin(-1)), 0.0)
    half = ((2.0 - s) + p1) < p0  # ties keep the integer coset
    for n, odd, j, up in ((n0, odd0, torch.argmax(k0, -1), m == 0),  # argmax/argmin: the first one
                          (n1, odd1, torch.argmin(v, -1), m == 1)):
        nj = n.gather(-1, j[..., None])
        upj = up.gather(-1, j[..., None])
        upj = torch.where(upj, nj < NMAX, nj == NMIN)  # at the box edge: inward
        step = torch.where(upj, 1, -1).to(torch.int32) * odd[..., None].to(torch.int32)
        n.scatter_add_(-1, j[..., None], step)
    return n0, n1, half


def e8_nearest(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest point of E8 in the box to each 8-vector z [..., 8] (any float, computed in float32).

    Returns (n int32 [..., 8] in [-8, 7] with even sum, c int32 [...] in {0, 1}); the point is
    p = n + c/2.
    """
    if z.shape[-1] != 8:
        raise ValueError(f"E8 blocks are 8-dimensional, got last dim {z.shape[-1]}")
    n0, n1, half = coset_candidates(z.to(torch.float32))
    return torch.where(half[..., None], n1, n0), half.to(torch.int32)


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


# ----------------------------------------------------------------------------- scale refit (rk4v4-e8 encoder)
# Same bitstream and decoder; only the stored fp16 scale and the chosen points change. Every
# quantity is exact or one IEEE float32 op in a fixed order, so kernels reproduce it bit for bit:
# z0 (the first code units, on GRID, |z0| <= 8) and the points p are on a 2^-9 grid with
# |z p| <= 64, so <z0, p> (< 2^21 grid steps) and <p, p> are exact float32 sums in ANY order.
#
#   p0 = E8(z0);   s1 = fp16_rn(min(s0 * (<z0,p0> / <p0,p0>), 65504))   least squares for p0
#   z1 = clamp(grid(z0 * (s0 / s1)), -8, 8);   p1 = E8(z1)               re-projection with s1
#   s2 = fp16_rn(min(s0 * (<z0,p1> / <p1,p1>), 65504))                   least squares for p1
#   keep (s2, p1) iff J(s2, p1) < J(s1, p0), J(s, p) = s * (s <p,p> - 2 s0 <z0,p>)
#
# J is the decoded-domain squared error |s0 z0 - s p|^2 less the constant |s0 z0|^2 (s0 z0 is x to
# within 2^-9 s0), with the fp16 scale actually stored. s1 is never worse than s0 for p0: the
# nearest fp16 to the least-squares optimum of a quadratic. A group whose s0 is 0 (all zero), or
# whose refit rounds to 0 (values near the fp16 subnormal floor), keeps s0 and p0.
_FP16_MAX = 65504.0


def _dots(z0: torch.Tensor, n: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """<z0, p> and <p, p> per group ([..., G, 8, 8] blocks -> [..., G]); exact in float32."""
    p = e8_point(n, c)
    return (z0 * p).sum((-1, -2)), (p * p).sum((-1, -2))


def _refit(s0: torch.Tensor, zp: torch.Tensor, pp: torch.Tensor) -> torch.Tensor:
    """fp16_rn(min(s0 * (zp / pp), 65504)) as float32; 0 where pp == 0."""
    q = zp / torch.where(pp > 0, pp, 1.0)
    s = torch.minimum(s0 * q, torch.tensor(_FP16_MAX)).to(torch.float16).to(torch.float32)
    return torch.where(pp > 0, s, 0.0)


def _cost(s: torch.Tensor, s0: torch.Tensor, zp: torch.Tensor, pp: torch.Tensor) -> torch.Tensor:
    return s * (s * pp - (s0 + s0) * zp)


def encode_e8_refit(z0: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rk4v4-e8's encoder: code units z0 [..., D] (on GRID, |z0| <= 8) of the scales s0 float32
    [..., G] (the represented fp16) -> (packed data uint8 [..., D/2], stored scales fp16 [..., G])."""
    zb = to_blocks(z0.to(torch.float32))
    if s0.shape != zb.shape[:-2]:
        raise ValueError(f"encode_e8_refit: scales {list(s0.shape)} do not match the groups {list(zb.shape[:-2])}")
    n0, c0 = e8_nearest(zb)
    zp0, pp0 = _dots(zb, n0, c0)
    s1 = _refit(s0, zp0, pp0)
    ok = s1 > 0
    t = (s0 / torch.where(ok, s1, 1.0))[..., None, None]  # float32 division
    z1 = (torch.round(zb.double() * t.double() / GRID) * GRID).clamp_(-8.0, 8.0).to(torch.float32)
    n1, c1 = e8_nearest(z1)
    zp1, pp1 = _dots(zb, n1, c1)
    s2 = _refit(s0, zp1, pp1)
    take = ok & (s2 > 0) & (_cost(s2, s0, zp1, pp1) < _cost(s1, s0, zp0, pp0))
    n = torch.where(take[..., None, None], n1, n0)
    c = torch.where(take[..., None], c1, c0)
    s = torch.where(take, s2, torch.where(ok, s1, s0))
    u = n + 8
    u[..., 7] = (u[..., 7] & 0xE) | c
    return pack_nibbles(u), s.to(torch.float16)
