"""Host CPU choices made once at engine start: the compute dtype (bf16 only where the CPU has native
bf16 matmul; elsewhere a bf16 `linear` is ~10x slower than fp32) and the intra-op thread count
(the physical cores other processes leave idle, unless the user chose: a `--threads` flag,
OMP_NUM_THREADS, or an earlier torch.set_num_threads)."""
from __future__ import annotations

import os
from functools import lru_cache

import torch

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_default_threads = torch.get_num_threads()  # at import: anything else was set by the user (or by us)
_ours: list[int] = []


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


@lru_cache(maxsize=1)
def native_bf16() -> bool:
    """True when the CPU computes bf16 matmuls natively (x86 AVX512-BF16/AMX, or Arm BF16)."""
    info = _cpuinfo()
    flags = set()
    for line in info.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return any(f in flags for f in _BF16_FLAGS) or "bf16" in flags  # "bf16": the Arm Features name


@lru_cache(maxsize=1)
def physical_cores() -> int:
    """Distinct (socket, core) pairs among the CPUs this process may run on."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores, cpu, phys = set(), None, "0"
    for line in _cpuinfo().splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "processor":
            cpu = int(val)
        elif key == "physical id":
            phys = val
        elif key == "core id" and cpu in allowed:
            cores.add((phys, val))
    return max(1, min(len(cores) or len(allowed), len(allowed)))


def idle_cores() -> tuple[int, str]:
    """Physical cores minus those other processes keep busy (1-minute load average): torch's
    threads spin-wait for each other, so one thread per core that is not free makes every op wait
    on a descheduled thread (measured here: 0.2 tok/s with 2 threads, 2.7 with 1, at load 10)."""
    cores = physical_cores()
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores, "physical cores"
    n = max(1, min(cores, cores - int(load)))
    return n, ("physical cores" if n == cores else f"{cores} physical cores, load {load:.1f}")


def compute_dtype(requested: torch.dtype) -> tuple[torch.dtype, str]:
    """The dtype to compute in on CPU when the user left --dtype auto, and why."""
    if requested in (torch.bfloat16, torch.float16) and not native_bf16():
        return torch.float32, f"fp32 (the CPU has no native bf16/fp16 matmul; --dtype {_name(requested)} forces it)"
    return requested, _name(requested)


def configure_threads(threads: int | None) -> tuple[int, str]:
    """Set torch's intra-op threads; returns (count, where it came from)."""
    now = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        n, why = threads, "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        return now, "OMP_NUM_THREADS"
    elif now != _default_threads and now not in _ours:
        return now, "torch.set_num_threads"
    else:
        n, why = idle_cores()
    torch.set_num_threads(n)
    _ours.append(n)
    return n, why


def _name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def resolve_device(device: str | torch.device) -> torch.device:
    """auto / cpu / cuda / cuda:N, with one-line errors for a bad name or a CUDA-less torch."""
    text = str(device).strip()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ValueError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {text!r}: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible")
            raise ValueError(f"--device {text}: {why} (torch {torch.__version__}); use --device cpu, "
                             "or install a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev
