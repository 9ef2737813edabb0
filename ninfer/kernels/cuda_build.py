"""CUDA C++ kernels compiled at first use: nvcc or NVRTC -> cubin (cached) -> driver API module -> launch.

The fast paths that Triton cannot express well (the 4-bit decode MMA kernel, the lane-per-word
store) are C++ sources under ``csrc/``, shipped with the package. A program is built once per set
of ``-D`` defines and GPU architecture, by the nvcc found on the machine or, without one, by NVRTC
(``nvrtc.py``: the library torch's CUDA wheels install), cached under ``~/.cache/ninfer/cuda`` (or
``$NINFER_CACHE_DIR/cuda``) by a hash of its sources, defines, architecture and compiler, loaded
with ``cuModuleLoadData`` and launched with ``cuLaunchKernel`` on torch's current stream (so CUDA
graphs capture it).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ninfer.kernels import nvrtc

CSRC = Path(__file__).parent / "csrc"


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        found = "/usr/local/cuda/bin/nvcc"
    return found


def compiler_unavailable() -> str | None:
    """None if nvcc or NVRTC can build csrc/ here, else why neither can."""
    if nvcc_path() is not None:
        return None
    why = nvrtc.unavailable()
    return None if why is None else f"no nvcc, and NVRTC: {why}"


def compiler_name() -> str:
    """The compiler build_defs uses: nvcc when there is one, else NVRTC (with its version)."""
    return "nvcc" if nvcc_path() is not None else "nvrtc-%d.%d" % nvrtc.version()


@functools.lru_cache(maxsize=None)
def _driver():
    drv = ctypes.CDLL("libcuda.so.1")
    drv.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    drv.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    drv.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    drv.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    drv.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    drv.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [
        ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    drv.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return drv


class CudaProgram:
    """One .cu file (plus headers) with ``extern "C"`` entry points (the first is the default),
    built per define set. ``src_dir``: where the files are read from (default: the package's csrc/;
    another directory builds another version of a source)."""

    def __init__(self, main: str, headers: tuple[str, ...], entry: str, src_dir: Path | None = None) -> None:
        self.files = {n: ((src_dir or CSRC) / n).read_text() for n in (*headers, main)}
        self.source = "".join(self.files.values())  # keys the cubin cache
        self.main, self.entry = main, entry
        self._funcs: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            _driver().cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{self.entry} (CUDA): {what} failed: {rc} {msg.value!r}")

    @staticmethod
    def cache_dir() -> Path:
        d = Path(os.environ.get("NINFER_CACHE_DIR", Path.home() / ".cache" / "ninfer")) / "cuda"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def build_defs(self, defs: dict, arch: str) -> Path:
        why = compiler_unavailable()
        if why is not None:
            raise RuntimeError(f"{self.entry} (CUDA): {why}")
        comp = compiler_name()
        tag = hashlib.sha1((self.source + repr(sorted(defs.items())) + arch + comp).encode()).hexdigest()[:16]
        out = self.cache_dir() / f"{self.entry}_{tag}.cubin"
        if out.exists():
            return out
        if comp != "nvcc":
            cubin = nvrtc.compile_cubin(self.files, self.main, defs, arch)
            with tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as f:
                f.write(cubin)
            os.replace(f.name, out)
            return out
        nvcc = nvcc_path()
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in self.files.items():
                (Path(tmp) / name).write_text(text)
            tmp_out = Path(tmp) / "out.cubin"
            cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", "-o", str(tmp_out), str(Path(tmp) / self.main)]
            cmd += [f"-D{k}={v}" for k, v in defs.items()]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{self.entry} (CUDA): nvcc failed:\n{res.stderr[-3000:]}")
            shutil.move(str(tmp_out), out)
        return out

    def load(self, defs: dict, device: torch.device, smem: int = 0, threads: int = 128,
             entry: str | None = None) -> tuple:
        """-> (module, function, smem, blocks per SM, registers), cached per (defs, entry, device)."""
        entry = entry or self.entry
        with self._lock:
            fkey = (tuple(sorted(defs.items())), entry, smem, threads, device.index)
            if fkey in self._funcs:
                return self._funcs[fkey]
            major, minor = torch.cuda.get_device_capability(device)
            path = self.build_defs(defs, f"sm_{major}{minor}")
            torch.cuda.init()
            with torch.cuda.device(device):
                torch.cuda.current_stream(device).synchronize()  # makes torch's context current
                drv = _driver()
                mod = ctypes.c_void_p()
                self._check(drv.cuModuleLoadData(ctypes.byref(mod), path.read_bytes()), "cuModuleLoadData")
                fn = ctypes.c_void_p()
                self._check(drv.cuModuleGetFunction(ctypes.byref(fn), mod, entry.encode()), "cuModuleGetFunction")
                if smem:
                    self._check(drv.cuFuncSetAttribute(fn, 8, smem), "cuFuncSetAttribute(max dynamic smem)")
                occ = ctypes.c_int()
                self._check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(occ), fn, threads, smem),
                            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
                regs = ctypes.c_int()
                drv.cuFuncGetAttribute(ctypes.byref(regs), 4, fn)  # CU_FUNC_ATTRIBUTE_NUM_REGS
            entry = (mod, fn, smem, max(1, occ.value), regs.value)
            self._funcs[fkey] = entry
            return entry

    def launch(self, fn, grid, block: int, smem: int, stream: int, args: list) -> None:
        """args: tensors (pointers), floats (f32), ("i64", v) tuples, ints (i32)."""
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            elif isinstance(a, tuple):
                holders.append(ctypes.c_int64(a[1]))
            else:
                holders.append(ctypes.c_int(a))
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        rc = _driver().cuLaunchKernel(fn, grid[0], grid[1], grid[2], block, 1, 1, smem,
                                      ctypes.c_void_p(stream), params, None)
        self._check(rc, "cuLaunchKernel")
