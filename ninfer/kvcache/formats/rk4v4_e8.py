"""``rk4v4-e8``, the headline format: rotated like rk4v4, fp16 scale per 64-group rounded up,
s = absmax/C_E8 (C = 8, see rk4v4.py for the sweep), code units on the 2^-8 grid, nearest E8 point
in the box, coset bit in nibble 7 (``e8.py``). ``e8.encode_e8_refit`` is a candidate encoder for the
same bytes (least-squares scale refit), measured by ``ninfer bench kl --text`` as ``rk4v4-e8:refit``.

``rk4v4-e8w``: the same pages (planes, store, kernels: ``kernel_code`` E8), plus a model-dtype ring of
each sequence's last ``WINDOW`` tokens' K/V that attention reads instead of their pages
(docs/KERNELS.md "rk4v4-e8w")."""
from __future__ import annotations

import torch

from ninfer.kvcache import e8 as _e8
from ninfer.kvcache.formats.base import KERNEL_E8, ScaledFormat

C_E8 = 8.0


class E8Format(ScaledFormat):
    code_grid = _e8.GRID

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        return _e8.encode_e8(z)

    def decode_codes(self, data: torch.Tensor) -> torch.Tensor:
        """p = n + c/2 per coordinate."""
        return _e8.decode_e8(data)


RK4V4_E8 = E8Format("rk4v4-e8", "H64-rotated 4-bit E8 lattice with coset bit, fp16 scale per 64", rotated=True,
                    packed=True, e8_lattice=True, has_scales=True, storage=torch.uint8, scale_divisor=C_E8,
                    kernel_code=KERNEL_E8)

WINDOW = 128
RK4V4_E8W = E8Format("rk4v4-e8w", f"rk4v4-e8 pages + the last {WINDOW} tokens' K/V in the model dtype",
                     rotated=True, packed=True, e8_lattice=True, has_scales=True, storage=torch.uint8,
                     scale_divisor=C_E8, kernel_code=KERNEL_E8, window=WINDOW)
