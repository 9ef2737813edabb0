"""Unquantized KV: ``auto`` (planes in the model dtype) and ``bf16``."""
from __future__ import annotations

import torch

from ninfer.kvcache.formats.base import KERNEL_PLAIN, KVFormat


class UnquantizedFormat(KVFormat):
    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (x if self.storage is None else x.to(self.storage)), None


AUTO = UnquantizedFormat("auto", "unquantized, model dtype", kernel_code=KERNEL_PLAIN)
BF16 = UnquantizedFormat("bf16", "unquantized bfloat16", storage=torch.bfloat16, kernel_code=KERNEL_PLAIN)
