"""A KV format defined outside the package, in one module: fp8 (e4m3) K/V without scales.

What adding a format takes: a ``KVFormat`` subclass with its encoder and decoder, an instance, and
``register_format``. It has no kernels (``kernel_code`` None), so the reference backend serves it
and a kernel backend refuses it at startup; the planner, pool and geometry line derive from its planes."""
from __future__ import annotations

import torch

from ninfer.kvcache.formats import KVFormat, register_format, unregister_format

FP8_MAX = 448.0


class Fp8Format(KVFormat):
    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        if bool((x.abs() > FP8_MAX).any()):
            raise ValueError(f"kv_dtype={self.name}: |K/V| > {FP8_MAX} does not fit e4m3 without a scale")
        return x.to(torch.float8_e4m3fn), None

    def decode_codes(self, data: torch.Tensor) -> torch.Tensor:
        return data.to(torch.float32)


TOY_FP8 = Fp8Format("toy-fp8", "fp8 e4m3, no scales", storage=torch.float8_e4m3fn)


class _MisreadFp8(Fp8Format):
    """The same bytes read as e5m2: a plausible decoder bug the parity bound must catch."""

    def decode_codes(self, data: torch.Tensor) -> torch.Tensor:
        return data.view(torch.float8_e5m2).to(torch.float32)


BROKEN_FP8 = _MisreadFp8("toy-fp8-misread", "fp8 e4m3 stored, read as e5m2 (wrong on purpose)",
                         storage=torch.float8_e4m3fn)


def register() -> None:
    for f in (TOY_FP8, BROKEN_FP8):
        register_format(f)


def unregister() -> None:
    for f in (TOY_FP8, BROKEN_FP8):
        unregister_format(f.name)
