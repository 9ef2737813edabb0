"""CUDA C++ -> cubin with NVRTC, for machines that have a GPU but no CUDA toolkit.

A pip-installed torch brings no ``nvcc``, but its CUDA wheels bring NVRTC (``libnvrtc``, under
``site-packages/nvidia/.../lib``) and triton brings the CUDA headers (``cuda_fp16.h`` and the rest,
under ``triton/backends/nvidia/include``). That is all it takes to build the ``csrc/`` kernels, so
the fast CUDA paths do not depend on a toolkit install. ``cuda_build`` uses nvcc when there is one
and this otherwise; both produce a cubin for the device's ``sm_XY``.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from pathlib import Path


def _candidates() -> list[str]:
    found = []
    for base in sys.path:  # pip's nvidia wheels: nvidia/cu13/lib (CUDA 13), nvidia/cuda_nvrtc/lib (12)
        for pat in ("nvidia/*/lib/libnvrtc.so*", "torch/lib/libnvrtc*.so*"):
            found += sorted(glob.glob(os.path.join(base, pat)), reverse=True)
    return [f for f in found if "builtins" not in f] + ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]


@functools.lru_cache(maxsize=None)
def _lib():
    """-> (the loaded libnvrtc, None) or (None, why not)."""
    errors = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                           ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for fn in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        for fn in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        return lib, None
    return None, "libnvrtc not found (" + "; ".join(errors[-2:]) + ")"


@functools.lru_cache(maxsize=None)
def cuda_include_dir() -> Path | None:
    """The CUDA headers triton ships (cuda_fp16.h, cuda_bf16.h, ...), if triton is installed."""
    try:
        import triton
    except ImportError:
        return None
    d = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    return d if (d / "cuda_fp16.h").exists() else None


def unavailable() -> str | None:
    """None if NVRTC can build the kernels here, else why not."""
    lib, why = _lib()
    if lib is None:
        return why
    if cuda_include_dir() is None:
        return "no CUDA headers (triton's backends/nvidia/include)"
    return None


def version() -> tuple[int, int]:
    lib, why = _lib()
    if lib is None:
        raise RuntimeError(f"NVRTC: {why}")
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_cubin(files: dict[str, str], main: str, defs: dict, arch: str) -> bytes:
    """Build `main` (its quoted includes resolved from `files`) for `arch` (e.g. "sm_90")."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"NVRTC: {why}")
    lib, _ = _lib()
    headers = [n for n in files if n != main]
    hsrc = (ctypes.c_char_p * len(headers))(*[files[n].encode() for n in headers])
    hnames = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
    opts = [f"--gpu-architecture={arch}", "--std=c++17", f"-I{cuda_include_dir()}"]
    opts += [f"-D{k}={v}" for k, v in defs.items()]
    copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(rc).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), files[main].encode(), main.encode(), len(headers), hsrc, hnames),
          "nvrtcCreateProgram")
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), copts)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC: {main} failed to compile for {arch}:\n{log.value.decode(errors='replace')[-3000:]}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        out = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
