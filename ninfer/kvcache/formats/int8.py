"""``int8``: NOT rotated; symmetric int8, one fp16 scale per 64-group, s = absmax/127 (rounded to
nearest, 2^-24 where it underflows), q = clamp(rint(x/s), -127, 127): upstream's group-64 int8
control the 4-bit formats are compared with."""
from __future__ import annotations

import torch

from ninfer.kvcache.formats.base import KERNEL_INT8, ScaledFormat

C_INT8 = 127.0


class Int8Format(ScaledFormat):
    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        return torch.round(z).clamp_(-127, 127).to(torch.int8)


INT8 = Int8Format("int8", "int8, fp16 scale per 64 (absmax/127), not rotated", has_scales=True,
                  storage=torch.int8, scale_divisor=C_INT8, kernel_code=KERNEL_INT8)
