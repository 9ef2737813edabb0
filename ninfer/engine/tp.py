"""Engine-side choices of a tensor-parallel run: which device each rank binds, how many CPU threads
each gets, and the memory the plan may count on (the least any rank has)."""
from __future__ import annotations

import torch

from ninfer.kvcache.memory import DeviceMemory


def rank_devices(device: torch.device, n: int) -> list[torch.device]:
    """Rank r binds cuda:(i + r) for --device cuda:i (cuda = cuda:0); on CPU every rank is on the CPU."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    if device.type != "cuda":
        return [device] * n
    base, count = device.index or 0, torch.cuda.device_count()
    if base + n > count:
        where = f"cuda:{base}..cuda:{base + n - 1}" if n > 1 else f"cuda:{base}"
        raise ValueError(f"--tensor-parallel-size {n} needs {n} GPU(s) ({where}) but {count} are visible; "
                         "lower it, or choose the GPUs with CUDA_VISIBLE_DEVICES")
    return [torch.device("cuda", base + r) for r in range(n)]


def threads_per_rank(threads: int, source: str, n: int) -> tuple[int, str]:
    """CPU ranks share the host's cores: an automatic thread count is split between them."""
    if n == 1 or source in ("--threads", "OMP_NUM_THREADS"):
        return threads, source
    per = max(1, threads // n)
    torch.set_num_threads(per)
    return per, f"{source}, split over {n} ranks"


def least_memory(driver: DeviceMemory, followers: list[DeviceMemory], device_type: str, n: int) -> DeviceMemory:
    """What the plan counts on per rank: the smallest device's; on CPU the ranks share one RAM."""
    mems = [driver, *followers]
    total, free = min(m.total for m in mems), min(m.free for m in mems)
    if device_type == "cpu":
        total, free = total // n, free // n
    return DeviceMemory(total, free)
