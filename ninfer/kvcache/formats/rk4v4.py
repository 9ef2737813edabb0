"""``rk4v4``: rotated (R = S.H64.S, ``kvcache/hadamard.py``), fp16 scale per 64-group rounded up,
s = absmax/C4, n = clamp(rint(z), -8, 7), 4-bit nibbles in the layout of ``e8.py`` (no coset bit).

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

import torch

from ninfer.kvcache import e8 as _e8
from ninfer.kvcache.formats.base import KERNEL_RK4, ScaledFormat

C_RK4 = 8.0


class RK4Format(ScaledFormat):
    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        return _e8.encode_scalar4(z)

    def decode_codes(self, data: torch.Tensor) -> torch.Tensor:
        return _e8.decode_scalar4(data)


RK4V4 = RK4Format("rk4v4", "H64-rotated 4-bit scalar rounding, fp16 scale per 64", rotated=True, packed=True,
                  has_scales=True, storage=torch.uint8, scale_divisor=C_RK4, kernel_code=KERNEL_RK4)
