"""CUDA C++ store for the 4-bit formats (rk4v4, rk4v4-e8): csrc/store_kv.cu, a thread per 64-group
for launches of ROWS_MIN_GROUPS 64-groups or more, eight lanes per group (one word each) below.

Same contract and bytes as ``store_kv_triton`` (which stays the portable path and the one
the CPU tests run): the kernel's arithmetic is ``csrc/kv_encode.cuh``, which the CPU tests also
build for the host and compare with the torch reference encoder bit for bit.
"""
from __future__ import annotations

import math

import torch

from ninfer.kernels._common import FMT_E8, FMT_RK4
from ninfer.kernels.cuda_build import CudaProgram, compiler_unavailable
from ninfer.kvcache.formats import KVFormat

THREADS = 128
# From this many 64-groups per launch (tokens x Hkv x D/64 x 2) on, one thread per group
# (kv_store_rows: a third of the instructions per coordinate); below it, eight lanes per group
# (kv_store: 8x the threads, so a short chunk still fills the GPU). H200, 8 kv heads, D128:
# rows / lanes = 1.37-1.58 (rk4v4-e8) and 1.18-1.24 (rk4v4) up
# to 256 tokens, 1.01 / 0.98 at 1024 tokens (32768 groups), 0.93 / 0.90 at 2048, 0.67 / 0.62 at 16384.
ROWS_MIN_GROUPS = 32768
_STORE = CudaProgram("store_kv.cu", ("rtc_compat.cuh", "kv_encode.cuh"), "kv_store")
_XT = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}
_ST = {torch.int64: "int64_t", torch.int32: "int32_t"}


def defs(code: int, x_dtype: torch.dtype, slot_dtype: torch.dtype) -> dict:
    return {"KV_FMT": code, "KV_XT": _XT[x_dtype], "KV_ST": _ST[slot_dtype]}


def cuda_store_unsupported(fmt: KVFormat, device: torch.device, x_dtype: torch.dtype, head_dim: int) -> str | None:
    """None if the CUDA store can serve this format and geometry, else the reason it cannot."""
    if fmt.kernel_code not in (FMT_RK4, FMT_E8):
        return f"format {fmt.name} has no CUDA store"
    if device.type != "cuda":
        return "not on CUDA"
    if x_dtype not in _XT:
        return f"input dtype {x_dtype}"
    if head_dim % 64 or (head_dim // 64) & (head_dim // 64 - 1):
        return f"head_dim {head_dim} (needs 64 x a power of 2)"
    divisor = float(fmt.scale_divisor or 0.0)
    if divisor <= 0 or divisor != 2.0 ** round(math.log2(divisor)):
        return f"scale divisor {divisor} is not a power of 2"
    return compiler_unavailable()


def load_store_cuda(fmt: KVFormat, device: torch.device, x_dtype: torch.dtype,
                    slot_dtype: torch.dtype = torch.int64) -> None:
    """Build and load both store entries now (startup), so a broken compiler is found before serving."""
    for entry in ("kv_store", "kv_store_rows"):
        _STORE.load(defs(fmt.kernel_code, x_dtype, slot_dtype), device, 0, THREADS, entry)


def store_kv_cuda(k: torch.Tensor, v: torch.Tensor, planes: dict, slot_mapping: torch.Tensor, fmt: KVFormat,
                  *, variant: dict | None = None) -> None:
    """The CUDA C++ store: same contract and bytes as ``store_kv_triton``; ValueError where it cannot run.
    variant: extra -D defines (the benchmark's register-cap variants)."""
    from ninfer.kernels.store_kv import checked_store_args
    code, kd, ks, vd, vs, page = checked_store_args(k, v, planes, slot_mapping, fmt)
    why = cuda_store_unsupported(fmt, k.device, k.dtype, k.shape[2])
    if why is None and k.shape[0] * 2 * (k.shape[2] // 64) * 8 >= 2**31:
        why = "too many tokens for one launch"
    if why is not None:
        raise ValueError(f"store_kv_cuda: {why}")
    if k.shape[0] == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    launch_store_kv_cuda(k, v, kd, ks, vd, vs, slot_mapping, code, float(fmt.scale_divisor), page, variant)


def launch_store_kv_cuda(k, v, kd, ks, vd, vs, slot_mapping, code: int, divisor: float, page: int,
                         variant: dict | None = None) -> None:
    """k/v [T, Hkv, D] (last dim contiguous) -> int32 word planes kd/vd [pages, Hkv, page, D/8] and
    fp16 scale planes ks/vs [pages, Hkv, page, D/64]; unchecked (``store_kv_cuda`` checks).
    variant: extra -D defines (the benchmark's register-cap variants)."""
    t, hkv, d = k.shape
    groups = d // 64
    rows = t * hkv * groups * 2 >= ROWS_MIN_GROUPS and all(
        x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0 for x in (k, v))
    entry = "kv_store_rows" if rows else "kv_store"
    _mod, fn, _smem, _occ, _regs = _STORE.load({**defs(code, k.dtype, slot_mapping.dtype), **(variant or {})},
                                                k.device, 0, THREADS, entry)
    grid = ((t * 2 * groups * (1 if rows else 8) + THREADS - 1) // THREADS, hkv, 1)
    stream = torch.cuda.current_stream(k.device).cuda_stream
    _STORE.launch(fn, grid, THREADS, 0, stream, [
        k, v, ("i64", k.stride(0)), ("i64", k.stride(1)), ("i64", v.stride(0)), ("i64", v.stride(1)),
        kd, ks, vd, vs, slot_mapping, t, hkv, groups.bit_length() - 1, page.bit_length() - 1, 1.0 / divisor])
