"""CUDA C++ split kernel for paged decode (int8, rk4v4, rk4v4-e8; the fast path on NVIDIA GPUs).

The Triton kernel in paged_decode.py is the portable path. On NVIDIA GPUs (sm_80+) the packed/int8 formats
also have a CUDA C++ split kernel: mma.sync tensor-core fragments built straight from the stored words (no
shared-memory re-layout of a converted tile), per-warp cp.async pipelines and PTX bit tricks. It is compiled
at first use (cuda_build.py: nvcc or NVRTC, cached cubin, driver API launch on torch's current stream, so
CUDA graphs capture it). Layout facts the fragments rely on (docs/KERNELS.md "CUDA path"):
* score MMA  S^T = K . Q^T : K is the A operand (16 tokens x k dims), Q^T the B operand. 4-bit formats:
  int8 MMAs (m16n8k32) on the nibbles as u8 (thread (gi = lane/4, ti = lane%4) masks words 2ti, 2ti+1 of
  tokens gi, gi+8 into their even / odd nibbles) against Q rounded to int8 per row and 64-group of the
  rotated domain (scale max|q| / 127, like llama.cpp's q8 activations; the extra error is bounded in
  tests/test_kernel_decode.py). int8 format: fp16 MMAs (m16n8k16) against fp16 Q.
* output MMA O^T = V^T . P^T : V^T is the A operand (16 dims x 16 tokens); thread gi converts
  word gi of each group of tokens 2ti, 2ti+1, 2ti+8, 2ti+9 to fp16, pairing two tokens per half2 with
  one prmt; P^T (fp16) comes from the score accumulators by two movmatrix transposes.
* E8: per word, the coset bit c and the parity of nibbles 0..6 enter as features of one extra fp16 MMA
  (K: a k-step, V: an m-tile), their bits counted by binary MMAs; K's group scale multiplies its
  accumulator, V's is folded into P per group.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from ninfer.kernels.cuda_build import CudaProgram, compiler_unavailable

from ninfer.kernels._common import FMT_E8, FMT_INT8, FMT_RK4, LOG2E, SM_COUNT as _SM_COUNT
from ninfer.kvcache.formats import GROUP, KVFormat

CUDA_FORMATS = (FMT_INT8, FMT_RK4, FMT_E8)  # kernel codes the split kernel has (its ND_FMT define)
# (NW warps, CHUNK tokens per pipeline stage, NST stages, MINB) per format and head dim, the fastest
# measured on the H200 (docs/BENCHMARKS.md "Tried and rejected"; head dims below
# 128 use the 128 entry). MINB = blocks per SM the registers must allow (ptxas's cap; 2 -> 128
# registers). rk4v4 at D128 runs capped at 2 blocks per SM: uncapped (166 registers, 1 block) was
# 4-6% slower. rk4v4-e8 at D128 runs 64-token chunks at one block of 8 warps (176 registers), 4-7%
# faster than capped 32-token chunks; at D256 such stages do not fit in shared memory. int8, the
# control the 4-bit kernels are compared with, was searched the same way. D256 fits one block.
CUDA_DEFAULT_CFG = {
    (FMT_INT8, 128): (8, 32, 2, 1), (FMT_INT8, 256): (8, 16, 2, 1),
    (FMT_RK4, 128): (8, 32, 2, 2), (FMT_RK4, 256): (8, 32, 2, 1),
    (FMT_E8, 128): (8, 64, 2, 1), (FMT_E8, 256): (8, 32, 2, 1),
}


def default_cfg(code: int, head_dim: int) -> tuple:
    return CUDA_DEFAULT_CFG[(code, 128 if head_dim <= 128 else 256)]


def _key(code: int, head_dim: int, q_dtype, cfg=None) -> tuple:
    nw, chunk, nst, *rest = tuple(cfg or default_cfg(code, head_dim))
    minb = rest[0] if rest and head_dim <= 128 else 1
    return (code, head_dim, "bf16" if q_dtype == torch.bfloat16 else "fp16", nw, chunk, nst, minb)


class _CudaDecode(CudaProgram):
    """The split kernel, one module per (format, head dim, q dtype, cfg) key."""

    def __init__(self, src_dir: Path | None = None) -> None:
        super().__init__("paged_decode.cu", ("rtc_compat.cuh", "decode_ops.cuh"), "nd_decode", src_dir)

    @staticmethod
    def defs(key: tuple) -> dict:
        fmt_c, d, qt, nw, chunk, nst, minb = key
        return {"ND_FMT": fmt_c, "ND_D": d, "ND_NW": nw, "ND_CHUNK": chunk, "ND_NST": nst, "ND_MINB": minb,
                "ND_QT": "__nv_bfloat16" if qt == "bf16" else "__half"}

    def build(self, key: tuple, arch: str) -> Path:
        return self.build_defs(self.defs(key), arch)

    def function(self, key: tuple, device: torch.device):
        return self.load(self.defs(key), device, _cuda_smem_bytes(key), key[3] * 32)


_CUDA = _CudaDecode()
_CUDA_SRC = _CUDA.source  # the kernel and its header (the emulation tests check their constants)


def _cuda_smem_bytes(key: tuple) -> int:
    fmt_c, d, _qt, nw, chunk, nst, _minb = key
    g = d // GROUP
    rb = d if fmt_c == 1 else d // 2
    stage = chunk * (2 * rb + 4 * g)
    return max(nw * nst * stage, nw * 8 * (d + 4) * 4)  # the stages, or the partials (rows padded: 4 floats, int8 1)


def cuda_decode_unsupported(fmt: KVFormat, device: torch.device, q_dtype: torch.dtype, head_dim: int,
                            num_heads: int, num_kv_heads: int, page_size: int) -> str | None:
    """None if the CUDA decode kernel can serve this geometry, else the reason it cannot."""
    if fmt.kernel_code not in CUDA_FORMATS:
        return f"format {fmt.name} has no CUDA path"
    if device.type != "cuda":
        return "not on CUDA"
    if _capability(device) < (8, 0):
        return "needs sm_80+"
    if head_dim not in (128, 256):
        return f"head_dim {head_dim}: CUDA path needs 128 or 256"
    if num_heads // num_kv_heads > 8:
        return f"GQA group {num_heads // num_kv_heads} > 8"
    if page_size != 64:
        return "page size != 64"
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q_dtype}"
    return _compiler()


def cuda_path_supported(q: torch.Tensor, kd: torch.Tensor, fmt: KVFormat) -> str | None:
    """None if the CUDA path can run this call, else the reason it cannot."""
    return cuda_decode_unsupported(fmt, q.device, q.dtype, q.shape[2], q.shape[1], kd.shape[1], kd.shape[2])


def load_decode_cuda(fmt: KVFormat, head_dim: int, device: torch.device, q_dtype: torch.dtype, cfg=None) -> None:
    """Build and load the split kernel now (startup), so a broken compiler is found before serving."""
    _CUDA.function(_key(fmt.kernel_code, head_dim, q_dtype, cfg), device)


_compiler = compiler_unavailable


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _paged_decode_cuda_split(q, kd, ks, vd, vs, block_tables, seq_lens, mid_o, mid_lse, code, scale,
                             splits, cfg) -> None:
    bsz, hq, d = q.shape
    hkv = kd.shape[1]
    # What the kernel addresses: a (page, head)'s rows contiguous, K / V (and their scales) at the same
    # page and head strides; paged_decode passes contiguous planes, a layout probe may pass views.
    for t, nm in ((kd, "k"), (vd, "v"), (ks, "k_scale"), (vs, "v_scale")):
        if t.stride()[2:] != (t.shape[3], 1):
            raise ValueError(f"paged_decode(cuda): plane {nm} needs contiguous rows within a page, strides {t.stride()}")
    if kd.stride() != vd.stride() or ks.stride() != vs.stride():
        raise ValueError(f"paged_decode(cuda): K and V planes need the same strides, got {kd.stride()} / "
                         f"{vd.stride()} and {ks.stride()} / {vs.stride()}")
    if max(kd.stride(0) * kd.element_size(), ks.stride(0) * ks.element_size()) >= 2 ** 32:
        raise ValueError("paged_decode(cuda): a page's stride must be < 4 GiB (32-bit page offsets)")
    key = _key(code, d, q.dtype, cfg)
    nw = key[3]
    _mod, fn, smem, _occ, _regs = _CUDA.function(key, q.device)
    esz = kd.element_size()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    _CUDA.launch(fn, (splits, hkv, bsz), nw * 32, smem, stream, [
        q, kd, ks, vd, vs, block_tables, seq_lens, mid_o, mid_lse,
        ("i64", q.stride(0)), ("i64", q.stride(1)),
        ("i64", kd.stride(0) * esz), ("i64", kd.stride(1) * esz),
        ("i64", ks.stride(0) * 2), ("i64", ks.stride(1) * 2), ("i64", block_tables.stride(0)),
        hq, hq // hkv, splits, float(scale) * LOG2E])


def cuda_num_splits(batch: int, num_kv_heads: int, max_pages: int, device: torch.device, fmt: KVFormat,
                    head_dim: int, q_dtype=torch.bfloat16, cfg=None) -> int:
    """Splits for the CUDA path: one wave of resident blocks (occupancy x SMs), from fixed sizes only."""
    code = fmt.kernel_code
    _mod, _fn, _smem, occ, _regs = _CUDA.function(_key(code, head_dim, q_dtype, cfg), device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    s = (occ * _SM_COUNT[idx]) // max(1, batch * num_kv_heads)
    return int(max(1, min(s, max_pages, 512)))


def cuda_q_as_rounded(q: torch.Tensor) -> torch.Tensor:
    """Q as the CUDA kernel's 4-bit score MMAs see it (float64, natural basis): rotated per 64-group, rounded
    to int8 with scale max|q| / 127 per row and group, rotated back. An oracle fed this Q measures the
    kernel's own arithmetic; the rounding is the one approximation it adds (see the module docstring)."""
    from ninfer.kvcache.hadamard import rotate
    r = rotate(q.double())
    g = r.reshape(*r.shape[:-1], r.shape[-1] // GROUP, GROUP)
    sc = g.abs().amax(-1, keepdim=True) / 127
    g = torch.where(sc > 0, torch.round(g / sc.clamp_min(1e-300)) * sc, torch.zeros_like(g))
    return rotate(g.reshape(r.shape))


def cuda_kernel_info(fmt: KVFormat, head_dim: int, device: torch.device, q_dtype=torch.bfloat16, cfg=None) -> dict:
    """Registers, shared memory and occupancy of the CUDA split kernel (for the benchmark report)."""
    code = fmt.kernel_code
    key = _key(code, head_dim, q_dtype, cfg)
    _mod, _fn, smem, occ, regs = _CUDA.function(key, device)
    return {"regs": regs, "dyn_smem": smem, "blocks_per_sm": occ, "warps": key[3], "chunk": key[4], "stages": key[5],
            "min_blocks": key[6]}
