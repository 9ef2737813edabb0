"""Candidate codecs for a second 4-bit KV format, measured by next-token KL (``kv_sim``, names ``v2:*``).

Each codec maps x [..., 64k] float32 to what its bytes would decode to (the simulation needs values,
not bitstreams); ``BITS`` is its cost in bits per stored value, scales and the coset bit included.
All but ``int4a`` and ``kivi`` use rk4v4-e8's rotation (``hadamard.rotate``, self-inverse):

* ``log2s32[-b]``: E8 codes as rk4v4-e8, but one scale per 32 values (E8 words 0-3 / 4-7 of a group):
  an 8-bit integer exponent B per 64 and a b-bit offset o per 32 (b = 7 by default), s = 2^(B - o/2^F),
  F = b - 2 (1/2^F-octave steps, 4 octaves below B), rounded up so code units stay in [-8, 8].
* ``compand``: rk4v4-e8's scale, E8 point of the companded code units u = 8 h^-1(z/8), decoded as
  8 h(p/8) with the cubic h(t) = t (A + (1 - A) t^2) (finer steps near 0, where rotated data is dense);
  ``compand-log2s32-5`` both changes.
* ``kivi``: K per channel along blocks of 64 tokens, V per token per 64, 4-bit asymmetric (fp16 min and
  step), no rotation; the current, unfinished key block stays unquantized (``Windowed``); ``kivi-nw``
  without that window (each block's scales then see its later tokens), ``e8-w64``: rk4v4-e8 with it.
  ``kivi128[-nw]``: K per channel along 128 tokens (4.25 bits) with [without] its 128-token window,
  V as rk4v4-e8; ``e8-w4`` / ``-w16`` / ``-w128``: rk4v4-e8 with such a window.
* ``nvfp4``: e2m1 values, an e4m3 scale per 16 (round to nearest), one float32 scale per tensor.
* ``int4a`` / ``int4a-r``: 4-bit asymmetric per 64 (fp16 min and step), plain / rotated.
* ``e8`` (rk4v4-e8), ``e8-refit`` (its candidate encoder), and any ``NAME-pN``: NAME on the channels of
  each 64-group permuted with seed N (``permuted``): equally good codecs whose KL spread is the noise.
"""
from __future__ import annotations

import math
import re

import torch

from ninfer.kvcache import e8
from ninfer.kvcache.formats import code_units, group_scales
from ninfer.kvcache.hadamard import rotate

# Compander slope at 0: SNR of companded(x, a) on x = torch.randn(8192, 64) (seed 0, ``snr_db``):
# a = 0.5 21.10, 0.6 21.44, 0.7 21.60, 0.75 21.61, 0.8 21.56, 0.9 21.31, 1 (= rk4v4-e8) 20.92 dB.
A = 0.75
TOKEN_BLOCK = 64  # kivi: tokens per key scale
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e8_points(z: torch.Tensor) -> torch.Tensor:
    """Code units [..., 64k] -> the nearest E8 point in rk4v4-e8's box, after its 2^-8 grid."""
    z = (torch.round(z.double() / e8.GRID) * e8.GRID).float()
    n, c = e8.e8_nearest(e8.to_blocks(z))
    return e8.from_blocks(e8.e8_point(n, c))


# ----------------------------------------------------------------------------- a: log2 scale per 32
def log2_scales(amax: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-32 absmax [..., G, 2] -> scales float64 [..., G, 2]: the smallest s = 2^(B - o/2^F) >= amax/8
    with B = ceil(log2 of the group's larger amax/8), o in [0, 2^bits) (clamped: a larger scale);
    0 for an all-zero group."""
    frac = 2.0 ** (bits - 2)
    need = amax.double() / 8.0
    top = need.amax(-1, keepdim=True)
    base = torch.ceil(torch.log2(torch.where(top > 0, top, 1.0)))
    if bool(((base < -128) | (base > 127)).any()):
        raise ValueError("log2s32: a group's scale exponent does not fit 8 bits")
    lg = torch.log2(need.clamp_min(1e-300))
    o = torch.floor((base - lg) * frac).clamp(0, 2 ** bits - 1)
    return torch.where(top > 0, torch.exp2(base - o / frac), 0.0)


def log2s32(x: torch.Tensor, bits: int = 7, a: float = 1.0) -> torch.Tensor:
    """Per-32 log2 scales, E8 codes (of the companded units where a < 1, as ``companded``)."""
    xr = rotate(x.float()).double()
    blk = e8.to_blocks(xr)  # [..., G, 8 (w), 8 (j)]
    halves = blk.reshape(*blk.shape[:-2], 2, 32)
    s = log2_scales(halves.abs().amax(-1), bits)[..., None]
    z = torch.where(s > 0, halves / torch.where(s > 0, s, 1.0), 0.0).reshape(blk.shape)
    p = e8_points((8.0 * expand(e8.from_blocks(z) / 8.0, a)).float())
    p = e8.to_blocks(8.0 * compand(p.double() / 8.0, a)).reshape(halves.shape)
    return rotate(e8.from_blocks((p * s).reshape(blk.shape)).float())


# ----------------------------------------------------------------------------- b: cubic compander
def compand(t: torch.Tensor, a: float = A) -> torch.Tensor:
    """h(t) = t (a + (1 - a) t^2): the decoder's map, monotone on [-1, 1] for 0 < a <= 1."""
    return t * (a + (1 - a) * t * t)


def expand(y: torch.Tensor, a: float = A) -> torch.Tensor:
    """h^-1(y) in float64 (Cardano: t^3 + p t + q = 0, p = a/(1-a) > 0, one real root)."""
    y = y.double()
    if a >= 1.0:
        return y
    p, q = a / (1 - a), -y / (1 - a)
    d = torch.sqrt(q * q / 4 + p ** 3 / 27)
    cbrt = lambda v: torch.sign(v) * v.abs() ** (1 / 3)  # noqa: E731
    return cbrt(-q / 2 + d) + cbrt(-q / 2 - d)


def companded(x: torch.Tensor, a: float = A) -> torch.Tensor:
    xr = rotate(x.float())
    s16, s = group_scales(xr, 8.0, round_up=True)
    z = code_units(xr, s)
    p = e8_points((8.0 * expand(z / 8.0, a)).float())
    zq = (8.0 * compand(p.double() / 8.0, a)).float()
    g = zq.reshape(*zq.shape[:-1], -1, 64) * s
    return rotate(g.reshape(zq.shape))


# ----------------------------------------------------------------------------- c, d: scalar rivals
def asym4(x: torch.Tensor, dim: int = -1, group: int = 64) -> torch.Tensor:
    """4-bit asymmetric along ``dim`` in groups of ``group`` (a short last group allowed): fp16 min
    and fp16 step (max - min)/15 rounded to nearest, q = clamp(rint((x - min)/step), 0, 15)."""
    x = x.float().movedim(dim, -1)
    n = x.shape[-1]
    pad = (-n) % group
    xp = torch.nn.functional.pad(x, (0, pad), value=float("nan")).reshape(*x.shape[:-1], -1, group)
    lo = torch.nan_to_num(xp, nan=float("inf")).amin(-1, keepdim=True)
    hi = torch.nan_to_num(xp, nan=float("-inf")).amax(-1, keepdim=True)
    lo16 = lo.half().float()
    step = ((hi - lo16) / 15).half().float()
    q = torch.where(step > 0, torch.round((xp - lo16) / torch.where(step > 0, step, 1.0)), 0.0).clamp(0, 15)
    out = (lo16 + q * step).reshape(*x.shape[:-1], n + pad)[..., :n]
    return out.movedim(-1, dim)


def nvfp4(x: torch.Tensor) -> torch.Tensor:
    """Rotated; per tensor g = amax / (6 * 448); per 16 values s = e4m3(amax16 / 6 / g), then the
    nearest e2m1 value of x / (s g) (clamped to +-6; ties to the lower magnitude)."""
    xr = rotate(x.float()).double()
    amax = float(xr.abs().max())
    if amax == 0:
        return x.float() * 0
    g = amax / (6 * 448)
    b = xr.reshape(*xr.shape[:-1], -1, 16)
    s = (b.abs().amax(-1, keepdim=True) / 6 / g).float().to(torch.float8_e4m3fn).double() * g
    y = torch.where(s > 0, b / torch.where(s > 0, s, 1.0), 0.0).clamp(-6, 6)
    mid = (E2M1[1:] + E2M1[:-1]) / 2
    mag = E2M1[torch.bucketize(y.abs(), mid)]
    return rotate((torch.sign(y) * mag * s).reshape(xr.shape).float())


class Windowed:
    """``codec`` on [N, D]; keys through ``along`` on [B, H, T, D] if given. With ``window`` a query
    attends the keys of its own, unfinished block of ``window`` tokens unquantized, as a cache that
    quantizes a block once it is full does (``attend``; 0: every key quantized)."""

    def __init__(self, codec, along=None, window: int = TOKEN_BLOCK) -> None:
        self.codec, self.window = codec, window
        if along is not None:
            self.keys = lambda k: along(k).to(k.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec(x)

    def attend(self, module, query, key_q, key_full, value, **kw):
        """Causal attention [B, Hq, T, D] of one unpadded sequence (what kv_sim runs): key_q for earlier
        blocks, key_full within the query's block."""
        g = query.shape[1] // key_q.shape[1]
        kq, kf, v = (t.repeat_interleave(g, 1).double() for t in (key_q, key_full, value))
        qd = query.double() * kw.get("scaling", module.scaling)
        t = torch.arange(query.shape[2], device=query.device)
        same = (t[:, None] // self.window) == (t[None, :] // self.window)
        sc = torch.where(same, qd @ kf.transpose(-1, -2), qd @ kq.transpose(-1, -2))
        sc = sc.masked_fill(t[None, :] > t[:, None], float("-inf"))
        out = torch.softmax(sc, -1) @ v
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


def kivi_keys(k: torch.Tensor, block: int = TOKEN_BLOCK) -> torch.Tensor:
    """K [B, H, T, D] per channel along blocks of ``block`` tokens (the last block may be short)."""
    return asym4(k, dim=-2, group=block)


def _rk4v4_e8(x: torch.Tensor) -> torch.Tensor:
    from ninfer.kvcache.formats import get_format
    f = get_format("rk4v4-e8")
    return f.decode(*f.encode(x)).float()


def permuted(codec, seed: int):
    """``codec`` on the channels of every 64-group in a fixed random order (then put back): an equally
    good codec with other rounding decisions, whose KL spread is the measurement's noise floor."""
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(seed))
    inv = torch.argsort(perm)

    def run(x: torch.Tensor) -> torch.Tensor:
        g = x.reshape(*x.shape[:-1], -1, 64)
        return codec(g[..., perm].reshape(x.shape)).reshape(g.shape)[..., inv].reshape(x.shape)
    return run


CODECS = {
    "v2:log2s32": lambda x: log2s32(x, 7),
    "v2:log2s32-6": lambda x: log2s32(x, 6),
    "v2:log2s32-5": lambda x: log2s32(x, 5),
    "v2:compand": companded,
    "v2:compand-log2s32-5": lambda x: log2s32(x, 5, A),
    "v2:kivi": Windowed(asym4, kivi_keys),
    "v2:kivi-nw": Windowed(asym4, kivi_keys, window=0),
    "v2:e8-w64": Windowed(_rk4v4_e8),
    "v2:kivi128": Windowed(_rk4v4_e8, lambda k: kivi_keys(k, 128), window=128),
    "v2:kivi128-nw": Windowed(_rk4v4_e8, lambda k: kivi_keys(k, 128), window=0),
    **{f"v2:e8-w{w}": Windowed(_rk4v4_e8, window=w) for w in (4, 16, 128)},
    "v2:e8": _rk4v4_e8,
    "v2:e8-refit": lambda x: __import__("ninfer.bench.kv_sim", fromlist=["e8_refit"]).e8_refit(x),
    "v2:nvfp4": nvfp4,
    "v2:int4a": asym4,
    "v2:int4a-r": lambda x: rotate(asym4(rotate(x.float()))),
}
BITS = {  # bits per stored value, scales included; rk4v4-e8 and its variants 4 + 16/64
    **{n: 4.25 for n in CODECS}, "v2:log2s32": 4 + 22 / 64, "v2:log2s32-6": 4 + 20 / 64,
    "v2:log2s32-5": 4 + 18 / 64, "v2:compand-log2s32-5": 4 + 18 / 64,
    **{n: 4.5 for n in ("v2:kivi", "v2:kivi-nw", "v2:nvfp4", "v2:int4a", "v2:int4a-r")},
    "rk4v4-e8": 4.25, "rk4v4-e8:refit": 4.25, "rk4v4": 4.25, "int8": 8.25}


def _split(name: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"(.+)-p(\d+)", name)
    return (m.group(1), int(m.group(2))) if m and m.group(1) in CODECS else (name, None)


def codec(name: str):
    """The codec of a ``v2:*`` name (no ``+c``); ``NAME-pN``: ``permuted`` with seed N. None if unknown."""
    base, seed = _split(name)
    if seed is None or base not in CODECS:
        return CODECS.get(base)
    return None if isinstance(CODECS[base], Windowed) else permuted(CODECS[base], seed)


def bits(name: str) -> float | None:
    """Bits per stored value of a codec name (``+c`` / ``+m`` ignored), None where not counted."""
    return BITS.get(_split(name[:-2] if name.endswith(("+c", "+m")) else name)[0])


def snr_db(x: torch.Tensor, xq: torch.Tensor) -> float:
    return 10 * math.log10(float((x.double() ** 2).sum() / ((x.double() - xq.double()) ** 2).sum()))
