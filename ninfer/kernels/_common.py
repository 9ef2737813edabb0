"""Constants shared by the attention kernels. The format variant a kernel switches on is the
format object's ``kernel_code`` (ninfer.kvcache.formats.base: one numbering for Triton and CUDA)."""
from __future__ import annotations

from ninfer.kvcache.formats.base import (KERNEL_E8 as FMT_E8, KERNEL_INT8 as FMT_INT8,  # noqa: F401
                                         KERNEL_PLAIN as FMT_PLAIN, KERNEL_RK4 as FMT_RK4, KVFormat)

LOG2E = 1.4426950408889634
SM_COUNT: dict[int, int] = {}  # device index -> multiprocessor count, filled on first use


def kernel_code(fmt: KVFormat, op: str) -> int:
    """The kernel variant of ``fmt``; a clear error for a name (pass the object) or a format without kernels."""
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"{op}: pass the KV format object (ninfer.kvcache.formats.get_format), got {fmt!r}")
    if fmt.kernel_code is None:
        raise ValueError(f"{op}: kv_dtype={fmt.name} has no kernels (the reference backend serves it)")
    return fmt.kernel_code
