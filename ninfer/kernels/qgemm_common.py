"""Pieces shared by the quantized-weight GEMMs (fp8_gemm.py, nvfp4_gemm.py): argument checks that
fail with one line, the split-K choice for decode batches, and the kernels' common epilogue.

Split-K is reduced inside the GEMM launch: every split stores its fp32 partial, then takes a ticket
from a per-tile counter; the split that draws the last ticket sums all partials in split order
(deterministic), adds the bias, writes the output and resets the counter to 0. A decode GEMM is
then one kernel, not a GEMM plus sum, bias and cast kernels (each a few microseconds of a ~5 us
decode GEMM). The counters live in one zeroed buffer per device and stream (GEMMs on two streams
may overlap) and are left zeroed."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.kernels._common import SM_COUNT

ACT_DTYPES = (torch.bfloat16, torch.float16)
SMALL_M = 64  # up to this many rows a GEMM is bound by its weight bytes: row tiles of 16..64, split over K


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 elsewhere (the interpreter), so small tests still split K."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in SM_COUNT:
        SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return SM_COUNT[idx]


def check_common(op: str, x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x as a 2-D [M, K] view (leading dims flattened); one-line errors for a wrong dtype or shape."""
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{op}: x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: x's last dim must be K={k} (the weight's), got x {list(x.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias must be [N={n}], got {list(bias.shape)}")
    if bias is not None and bias.device != x.device:
        raise ValueError(f"{op}: bias is on {bias.device}, x on {x.device}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{op}: runs on CUDA tensors (x is on {x.device}); on CPU multiply by the dequantized weight")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def check_device(op: str, x: torch.Tensor, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device != x.device:
            raise ValueError(f"{op}: every tensor must be on x's device {x.device}, got one on {t.device}")


def row_tile(m: int) -> int:
    """The row tile of a small-M GEMM: the MMA's 16 rows up to M = 16, else M rounded up to 32 / 64."""
    return min(SMALL_M, max(16, triton.next_power_of_2(m)))


def split_k(device: torch.device, n_tiles: int, k_blocks: int) -> tuple[int, int]:
    """(splits, K blocks per split) for a small-M GEMM: enough programs to keep every SM reading
    (~4 per SM, so an uneven last round of programs costs little); each split keeps at least 2 K
    blocks so the partial sums stay a small fraction of the weight bytes."""
    want = triton.cdiv(4 * sm_count(device), max(n_tiles, 1))
    split = max(1, min(want, k_blocks // 2 if k_blocks >= 4 else 1))
    per = triton.cdiv(k_blocks, split)
    return triton.cdiv(k_blocks, per), per


MAX_TILES = 4096  # split-K only runs with fewer than 2 programs per SM, so few output tiles
_COUNTERS: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The zeroed split-K ticket counters of the device's current stream (made once; the kernels
    leave them zeroed)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def split_buffers(m: int, n: int, split: int, n_tiles: int, dtype: torch.dtype, device: torch.device):
    """(out [M, N], fp32 partials [split, M, N] or out itself, ticket counters) for a launch."""
    out = torch.empty((m, n), dtype=dtype, device=device)
    if split == 1:
        return out, out, out
    if n_tiles > MAX_TILES:
        raise AssertionError(f"split-K over {n_tiles} tiles > {MAX_TILES}")
    return out, torch.empty((split, m, n), dtype=torch.float32, device=device), counters(device)


@triton.jit
def _write(acc, o_ptr, bias_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr):
    mo = (rm < M)[:, None] & (rn < N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=mo)


@triton.jit
def epilogue(acc, o_ptr, p_ptr, cnt_ptr, bias_ptr, rm, rn, M, N, tile, pid_s, n_split,
             HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr):
    """Write acc (+ bias) as the output (DIRECT), or store this split's partial and, in the split
    that finishes last, write the sum of all partials in split order."""
    if DIRECT:
        _write(acc, o_ptr, bias_ptr, rm, rn, M, N, HAS_BIAS)
    else:
        mo = (rm < M)[:, None] & (rn < N)[None, :]
        offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
        plane = M * N  # split-K runs at decode sizes only: the partials fit int32 offsets
        tl.store(p_ptr + pid_s * plane + offs, acc, mask=mo)
        # the atomic runs in one thread: the barrier orders every thread's partial stores before
        # its release; the last split reads the partials from L2 (.cg), after its acquire
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == n_split - 1:
            total = tl.zeros_like(acc)
            for s in range(0, n_split):
                total += tl.load(p_ptr + s * plane + offs, mask=mo, other=0.0, cache_modifier=".cg")
            _write(total, o_ptr, bias_ptr, rm, rn, M, N, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + tile, 0)
