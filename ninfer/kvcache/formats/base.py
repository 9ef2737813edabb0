"""The KV format contract (``KVFormat``), its planes (``Plane``) and the shared scale helpers.

A format is an object: the pool, the planner, the attention backends and the kernels all take the
object, never its name. What a format says about itself:

* ``name``, ``description``; flags ``rotated`` (stored in the H64-rotated domain), ``packed`` (two
  4-bit coordinates per byte), ``e8_lattice``, ``has_scales`` (fp16 scale per 64-group);
  ``storage`` (the plane dtype, None = the model dtype), ``scale_divisor`` (C in s = absmax / C).
* ``window``: 0, or W for a format whose sequences also hold a model-dtype ring of their last W
  tokens' K/V (per attention layer, per sequence slot; the pool allocates it, the backends read it).
* ``kernel_code``: the ONE number the kernels switch on (Triton constexpr ``FMT``, the CUDA
  ``ND_FMT`` / ``KV_FMT`` defines): ``KERNEL_PLAIN`` .. ``KERNEL_E8`` below, or None for a format
  with no kernels (served by the reference backend only; a kernel backend refuses it at startup).
* ``planes(head_dim, model_dtype)``, ``bytes_per_token_head``, ``geometry_line``: the geometry
  the pool allocates and the startup log prints, derived from the planes.
* ``encode(x) -> (data, scale | None)`` and ``decode(data, scale)``: the torch reference the
  kernels are tested against; a subclass implements ``_encode`` and ``decode_codes``.

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
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping

import torch

from ninfer.kvcache.hadamard import rotate

GROUP = 64
_FP16_MAX = 65504.0
_FP16_MIN_SUBNORMAL = 2.0 ** -24

# Kernel variants (one numbering for the Triton kernels and the CUDA sources' defines).
KERNEL_PLAIN, KERNEL_INT8, KERNEL_RK4, KERNEL_E8 = 0, 1, 2, 3


@dataclass(frozen=True)
class Plane:
    """One tensor per layer, shape [num_pages, num_kv_heads, page_size, extent]."""
    name: str  # "k", "k_scale", "v", "v_scale"
    dtype: torch.dtype
    extent: int  # elements per (token, kv head)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def check_finite(x: torch.Tensor) -> None:
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
class KVFormat(ABC):
    """Base class of every KV format; a subclass implements ``_encode`` (and ``decode_codes`` if
    it has scales). Instances are immutable and hashable (kernels cache compiled variants on them)."""
    name: str
    description: str = ""
    rotated: bool = False
    packed: bool = False
    e8_lattice: bool = False
    has_scales: bool = False
    storage: torch.dtype | None = None  # None: the model dtype (auto)
    scale_divisor: float | None = None  # C in s = absmax / C
    kernel_code: int | None = None      # None: no kernels (reference backend only)
    window: int = 0                     # > 0: each sequence also keeps its last `window` tokens' K/V in
                                        # the model dtype, attended instead of their pages (rk4v4-e8w)

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
                f"dtype={dtype_name(k.dtype)} scales={scales}")

    # ------------------------------------------------------------------ codec
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., D] float -> (data [..., extent], scale fp16 [..., D/64] or None)."""
        check_finite(x)
        self._check_dim(x.shape[-1])
        return self._encode(x)

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., D] float, finite -> (data, scale or None): the format's encoder."""

    def decode_codes(self, data: torch.Tensor) -> torch.Tensor:
        """Code values (before scaling) as float32 [..., D]."""
        return data.to(torch.float32)

    def decode(self, data: torch.Tensor, scale: torch.Tensor | None, *, rotated: bool = False,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(data, scale) -> values [..., D]. ``rotated=True`` stays in the H64 domain (rotated formats)."""
        if not self.has_scales:
            return self.decode_codes(data).to(dtype)
        if scale is None:
            raise ValueError(f"kv_dtype={self.name} needs its fp16 scales to decode")
        codes = self.decode_codes(data)
        g = codes.reshape(*codes.shape[:-1], codes.shape[-1] // GROUP, GROUP)
        x = (g * scale.to(torch.float32)[..., None]).reshape(codes.shape)
        if self.rotated and not rotated:
            x = rotate(x)
        return x.to(dtype)


class ScaledFormat(KVFormat):
    """fp16 scale per 64-group (``group_scales``), optional H64 rotation, then ``quantize`` the code
    units. 4-bit (packed) formats round their scales up, int8 to nearest."""

    code_grid: float | None = None  # code units rounded to this grid (rk4v4-e8), else float32 products

    @abstractmethod
    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Code units (x / scale, rotated if the format is) -> the stored codes."""

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        xr = rotate(x).to(torch.float32) if self.rotated else x.to(torch.float32)
        s16, s = group_scales(xr, float(self.scale_divisor), round_up=self.packed)
        return self.quantize(code_units(xr, s, self.code_grid)), s16
