"""KV format registry (DESIGN 2, docs/ARCHITECTURE.md "KV formats"): planes, bytes, encode/decode.

Every other module (planner, pool, kernels, logs) reads the format from here; ``encode`` and
``decode`` are the torch reference the kernels are tested against.

Formats
-------
* ``auto``   unquantized, planes in the model dtype.
* ``bf16``   unquantized bfloat16.
* ``int8``   NOT rotated; symmetric int8, one fp16 scale per 64-group, s = absmax/127,
             q = clamp(rint(x/s), -127, 127) (upstream's group-64 int8 control).
* ``rk4v4``  rotated (R = S.H64.S, ``hadamard.py``), fp16 scale per 64-group, s = absmax/C4, n = clamp(rint(z), -8, 7),
             4-bit nibbles in the layout of ``e8.py`` (no coset bit).
* ``rk4v4-e8`` rotated like rk4v4, fp16 scale per 64-group, s = absmax/C_E8, nearest E8 point in the
             box, coset bit in nibble 7 (``e8.py``). The headline format.

Scales (all scaled formats, bit-exact rule): ``s = fp16(absmax / C)`` with absmax and the
division in float32. int8 rounds to the nearest fp16 (even on ties); a group that is not all zero
but whose scale underflows to 0 gets the smallest fp16 subnormal 2^-24 instead. The 4-bit formats
round up (the smallest fp16 >= absmax / C, so never 0 for a nonzero group): then every code unit
lies in [-8, 8] (|x| <= C s, and x * RN(1/s) cannot round past 8), the domain the CUDA E8
encoder is written for, even where s is an fp16 subnormal with few significant bits. An all-zero
group has s = 0 and codes 0, so it decodes exactly to 0. Code units are ``z = x * RN(1 / s)``
with the *represented* fp16 s (float32 IEEE ops; within 1.5 ulp of x / s); rk4v4-e8 rounds
the exact product to the 2^-8 grid instead (``e8.GRID``: exact fp16 values, see there).
NaN/Inf input, or a group whose scale would overflow fp16, raises ValueError.

Scale constant C (s = absmax/C), measured with ``ninfer bench codec --sweep-c`` (N(0,1) after
the rotation, 2^21 values, fp16 scales; docs/BENCHMARKS.md "Codec (CPU)"):
  C      7.0    7.5    7.75   8.0    8.25   8.5    9.0
  rk4v4  19.35  19.76  19.97  20.06  20.03  19.89  19.34   dB
  e8     19.94  20.53  20.76  20.92  20.97  20.88  20.38   dB
(heavy-tailed data b, 2^20 values: rk4v4 peaks at 7.75, 0.06 dB above C = 8; rk4v4-e8 at 8.)
C = 8 for both: the rk4v4 optimum, 0.04 dB below the rk4v4-e8 optimum (8.25), and a power of two,
so absmax/C is exact (= absmax * 0.125): a kernel that multiplies by 1/C instead of dividing
cannot round differently. With C = 8 the positive side clips at 7 (7.5 for E8) only values
above 15/16 of the group absmax; the negative side reaches -8 exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from ninfer.kvcache import e8 as _e8
from ninfer.kvcache.hadamard import rotate

GROUP = 64
C_INT8 = 127.0
C_RK4 = 8.0
C_E8 = 8.0
_FP16_MAX = 65504.0
_FP16_MIN_SUBNORMAL = 2.0 ** -24

_REFUSED = {
    "rk2v4-e8": "rk2v4-e8 is refused: the 2-bit E8-root (cylinder) key codebook of the seed lineage "
                "loses too much K precision for retrieval and has no exact-decode spec here; use rk4v4-e8",
}


@dataclass(frozen=True)
class Plane:
    """One tensor per layer, shape [num_pages, num_kv_heads, page_size, extent]."""
    name: str  # "k", "k_scale", "v", "v_scale"
    dtype: torch.dtype
    extent: int  # elements per (token, kv head)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _check_finite(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"KV encode expects a floating-point tensor, got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"KV encode got {bad} non-finite value(s) (NaN/Inf) in K/V; refusing to store them")


def group_scales(x: torch.Tensor, divisor: float, round_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-64-group fp16 scales of x [..., D] (float32). Returns (scale fp16 [..., G], s float32 [..., G, 1]).
    round_up: the 4-bit rule (the fp16 value at or above absmax / divisor), else round to nearest."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    raw = amax / divisor
    if bool((raw > _FP16_MAX).any()):
        raise ValueError(f"KV group absmax {float(amax.max()):.6g} overflows the fp16 scale "
                         f"(absmax/{divisor:g} > {_FP16_MAX}); the model's K/V are out of range")
    s16 = raw.to(torch.float16)
    if round_up:  # one fp16 step up where rounding went down (raw >= 0: the bits are monotonic)
        s16 = torch.where(s16.float() < raw, (s16.view(torch.int16) + 1).view(torch.float16), s16)
    else:
        s16 = torch.where((s16 == 0) & (amax > 0), torch.tensor(_FP16_MIN_SUBNORMAL, dtype=torch.float16), s16)
    return s16, s16.to(torch.float32)[..., None]


def code_units(x: torch.Tensor, s: torch.Tensor, grid: float | None = None) -> torch.Tensor:
    """z = x * y per group, y = RN(1 / s) (0 where s == 0, where x is all 0); x float32 [..., D],
    s [..., G, 1] -> [..., D]. A multiply, not a division, so a kernel spends one op per value.
    grid: round the exact product x * y to this power of 2 instead (once, half to even): in float64,
    where the product of two float32 is exact (a kernel's fma(x, y, 1.5 * 2^k) - 1.5 * 2^k)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    y = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
    if grid is None:
        return (g * y).reshape(x.shape)
    z = torch.round(g.double() * y.double() / grid) * grid
    return z.to(torch.float32).reshape(x.shape)


@dataclass(frozen=True)
class KVFormat:
    name: str
    rotated: bool
    packed: bool
    e8_lattice: bool
    has_scales: bool
    storage: torch.dtype | None  # None: the model dtype (auto)
    scale_divisor: float | None = None  # C in s = absmax / C
    description: str = ""

    # ------------------------------------------------------------------ geometry
    def _check_dim(self, head_dim: int) -> None:
        if head_dim <= 0 or (self.has_scales and head_dim % GROUP != 0):
            raise ValueError(f"kv_dtype={self.name} needs head_dim to be a positive multiple of {GROUP}, got {head_dim}")

    def data_dtype(self, model_dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
        return model_dtype if self.storage is None else self.storage

    def data_extent(self, head_dim: int) -> int:
        self._check_dim(head_dim)
        return head_dim // 2 if self.packed else head_dim

    def planes(self, head_dim: int, model_dtype: torch.dtype = torch.bfloat16) -> tuple[Plane, ...]:
        """Planes per layer, in allocation order: k, [k_scale], v, [v_scale]."""
        ext, dt = self.data_extent(head_dim), self.data_dtype(model_dtype)
        out: list[Plane] = []
        for kv in ("k", "v"):
            out.append(Plane(kv, dt, ext))
            if self.has_scales:
                out.append(Plane(f"{kv}_scale", torch.float16, head_dim // GROUP))
        return tuple(out)

    def bytes_per_token_head(self, head_dim: int, model_dtype: torch.dtype = torch.bfloat16) -> int:
        """K + V bytes per token per KV head, scales included."""
        return sum(p.extent * torch.empty((), dtype=p.dtype).element_size() for p in self.planes(head_dim, model_dtype))

    def geometry_line(self, head_dim: int, model_dtype: torch.dtype = torch.bfloat16,
                      allocated: Mapping[str, torch.Tensor] | None = None) -> str:
        """DESIGN 2.2 line. With ``allocated`` (plane name -> tensor [..., extent]) the line is built
        from the tensors actually allocated and a mismatch with this format raises RuntimeError."""
        expect = {p.name: p for p in self.planes(head_dim, model_dtype)}
        if allocated is not None:
            if set(allocated) != set(expect):
                raise RuntimeError(f"kv_dtype={self.name}: allocated planes {sorted(allocated)} != expected {sorted(expect)}")
            for name, t in allocated.items():
                p = expect[name]
                if t.dtype != p.dtype or t.shape[-1] != p.extent:
                    raise RuntimeError(f"kv_dtype={self.name}: plane {name} allocated {t.dtype} x {t.shape[-1]}, "
                                       f"format says {p.dtype} x {p.extent}")
        k = expect["k"]
        scales = f"fp16x{head_dim // GROUP}" if self.has_scales else "none"
        return (f"kv planes: kv_dtype={self.name} packed_k={int(self.packed)} packed_v={int(self.packed)} "
                f"e8_lattice={int(self.e8_lattice)} e8_root=0 extent={head_dim}->{k.extent} "
                f"dtype={_dtype_name(k.dtype)} scales={scales}")

    # ------------------------------------------------------------------ codec
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., D] float -> (data [..., extent], scale fp16 [..., D/64] or None)."""
        _check_finite(x)
        self._check_dim(x.shape[-1])
        if self.storage is None:
            return x, None
        if not self.has_scales:
            return x.to(self.storage), None
        xr = rotate(x).to(torch.float32) if self.rotated else x.to(torch.float32)
        s16, s = group_scales(xr, float(self.scale_divisor), round_up=self.packed)
        z = code_units(xr, s, _e8.GRID if self.e8_lattice else None)
        if self.e8_lattice:  # the scale refit (e8.encode_e8_refit) picks the stored scale and points
            return _e8.encode_e8_refit(z, s[..., 0])
        if self.packed:
            return _e8.encode_scalar4(z), s16
        return torch.round(z).clamp_(-127, 127).to(torch.int8), s16

    def decode_codes(self, data: torch.Tensor) -> torch.Tensor:
        """Code values (before scaling) as float32 [..., D]: n, or p = n + c/2 for rk4v4-e8."""
        if self.e8_lattice:
            return _e8.decode_e8(data)
        if self.packed:
            return _e8.decode_scalar4(data)
        return data.to(torch.float32)

    def decode(self, data: torch.Tensor, scale: torch.Tensor | None, *, rotated: bool = False,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(data, scale) -> values [..., D]. ``rotated=True`` stays in the H64 domain (rotated formats)."""
        if not self.has_scales:
            return data.to(dtype)
        if scale is None:
            raise ValueError(f"kv_dtype={self.name} needs its fp16 scales to decode")
        codes = self.decode_codes(data)
        g = codes.reshape(*codes.shape[:-1], codes.shape[-1] // GROUP, GROUP)
        x = (g * scale.to(torch.float32)[..., None]).reshape(codes.shape)
        if self.rotated and not rotated:
            x = rotate(x)
        return x.to(dtype)


_FORMATS: dict[str, KVFormat] = {
    "auto": KVFormat("auto", False, False, False, False, None, None, "unquantized, model dtype"),
    "bf16": KVFormat("bf16", False, False, False, False, torch.bfloat16, None, "unquantized bfloat16"),
    "int8": KVFormat("int8", False, False, False, True, torch.int8, C_INT8,
                     "int8, fp16 scale per 64 (absmax/127), not rotated"),
    "rk4v4": KVFormat("rk4v4", True, True, False, True, torch.uint8, C_RK4,
                      "H64-rotated 4-bit scalar rounding, fp16 scale per 64"),
    "rk4v4-e8": KVFormat("rk4v4-e8", True, True, True, True, torch.uint8, C_E8,
                         "H64-rotated 4-bit E8 lattice with coset bit, fp16 scale per 64"),
}
FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)


def get_format(name: str) -> KVFormat:
    """The registry entry for ``name``; refused and unknown names raise ValueError."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key in _REFUSED:
        raise ValueError(_REFUSED[key])
    if key not in _FORMATS:
        raise ValueError(f"unknown kv_dtype {name!r}; valid: {', '.join(FORMAT_NAMES)}")
    return _FORMATS[key]
