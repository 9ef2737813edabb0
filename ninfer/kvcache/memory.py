"""How much memory a device has (total, free), probed before the planner sizes anything, and the
byte formatting of the startup lines."""
from __future__ import annotations

import os
from typing import Any, NamedTuple

GiB = 1 << 30
MiB = 1 << 20


class DeviceMemory(NamedTuple):
    total: int
    free: int


def format_bytes(n: int | float) -> str:
    """Two decimals, GiB from 1 GiB up, MiB below (the seed engine's startup-line convention)."""
    sign = "-" if n < 0 else ""
    a = abs(n)
    return f"{sign}{a / GiB:.2f} GiB" if a >= GiB else f"{sign}{a / MiB:.2f} MiB"


def _cpu_memory() -> DeviceMemory:
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    free = page * os.sysconf("SC_AVPHYS_PAGES")
    try:  # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES does not.
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return DeviceMemory(total, free)


def device_memory(device: Any, memory_limit_gib: float | None = None) -> DeviceMemory:
    """Total and free bytes of `device` ("cpu", "cuda", "cuda:N" or a torch.device). With a limit,
    the device is treated as that large (at most its real size): on CUDA what is already in use
    still counts against it, so the limit emulates a smaller card of the same kind."""
    import torch
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        if memory_limit_gib is None:
            return DeviceMemory(int(total), int(free))
        limit = min(int(memory_limit_gib * GiB), int(total))  # never plan beyond the real card
        return DeviceMemory(limit, max(0, min(int(free), limit - (int(total) - int(free)))))
    if dev.type != "cpu":
        raise ValueError(f"unsupported device {device!r}: use cpu or cuda[:N]")
    mem = _cpu_memory()
    if memory_limit_gib is None:
        return mem
    limit = min(int(memory_limit_gib * GiB), mem.total)
    return DeviceMemory(limit, min(mem.free, limit))
