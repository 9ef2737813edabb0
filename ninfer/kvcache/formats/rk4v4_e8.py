"""``rk4v4-e8``, the headline format: rotated like rk4v4, fp16 scale per 64-group rounded up,
s = absmax/C_E8 (C = 8, see rk4v4.py for the sweep), code units on the 2^-8 grid, nearest E8 point
in the box, coset bit in nibble 7 (``e8.py``). The encoder refits the scale by least squares and
re-projects once (``e8.encode_e8_refit``); ``quantize`` is the plain nearest point at s (the first
encoder, kept for the benches)."""
from __future__ import annotations

import torch

from ninfer.kvcache import e8 as _e8
from ninfer.kvcache.formats.base import KERNEL_E8, ScaledFormat, code_units, group_scales
from ninfer.kvcache.hadamard import rotate

C_E8 = 8.0


class E8Format(ScaledFormat):
    code_grid = _e8.GRID

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Nearest E8 points at the given scale (no refit): the baseline encoder, for comparisons."""
        return _e8.encode_e8(z)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xr = rotate(x).to(torch.float32)
        _, s = group_scales(xr, float(self.scale_divisor), round_up=True)
        return _e8.encode_e8_refit(code_units(xr, s, self.code_grid), s[..., 0])

    def decode_codes(self, data: torch.Tensor) -> torch.Tensor:
        """p = n + c/2 per coordinate."""
        return _e8.decode_e8(data)


RK4V4_E8 = E8Format("rk4v4-e8", "H64-rotated 4-bit E8 lattice with coset bit, fp16 scale per 64", rotated=True,
                    packed=True, e8_lattice=True, has_scales=True, storage=torch.uint8, scale_divisor=C_E8,
                    kernel_code=KERNEL_E8)
