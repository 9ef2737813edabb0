"""Constants shared by the attention kernels: the format kind each kernel switches on."""
from __future__ import annotations

FMT_PLAIN, FMT_INT8, FMT_RK4, FMT_E8 = 0, 1, 2, 3
LOG2E = 1.4426950408889634
SM_COUNT: dict[int, int] = {}  # device index -> multiprocessor count, filled on first use


def fmt_code(fmt) -> int:
    """Kernel format kind of a `ninfer.kvcache.formats.KVFormat`."""
    if not fmt.has_scales:
        return FMT_PLAIN
    if fmt.e8_lattice:
        return FMT_E8
    return FMT_RK4 if fmt.packed else FMT_INT8
