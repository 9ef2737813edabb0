"""Weight-only GEMV kernels for decode-sized batches (M <= MAX_M rows) of FP8-block and NVFP4 weights.

A decode GEMM reads every weight byte once and does little arithmetic per byte, so it should run at
the copy bandwidth. Here each program owns BLOCK_N rows of W (contiguous along K) and a K range:
it loads W tiles with K fastest (vector loads: 16 FP8 codes, or 8 NVFP4 bytes = one scale group),
dequantizes them in registers, multiplies them by all M rows of x (broadcast along N) and reduces
over K with tl.sum in fp32 -- no tl.dot, whose 16-row minimum tile wastes most of an MMA at
M = 1..8 and whose operand layout sends the weight through shared memory. W is read once per
program for all rows.
K is split over programs so a grid keeps every SM reading; the splits are summed in a fixed order
by qgemm_common.epilogue (deterministic).

FP8: ``w = e4m3 * weight_scale_inv[n // 128, k // 128]``; a thread's 16 codes lie in one scale
block, so the scale multiplies their fp32 sum, not every element. NVFP4: the packed bytes
are [groups of 16 codes, 8 bytes]; low nibbles multiply x's even columns, high nibbles the odd
ones, the e4m3 scale multiplies each group's sum, the global scale the accumulator once.

The tile config (BLOCK_N, BLOCK_K, warps, programs per SM, stages) comes from a small table, timed once per
(device, row bucket, N, K) on first use and kept for the process (outside a CUDA-graph capture;
during one the table's first fitting config is taken and kept)."""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ninfer.kernels.qgemm_common import epilogue, sm_count, split_buffers

log = logging.getLogger(__name__)
# Default dispatch: up to this many rows run the GEMV (above it the tl.dot kernels). H200, `ninfer bench
# gemm`: the GEMV is faster on every Qwen3-8B shape up to M = 2 (FP8) and M = 4 (NVFP4).
GEMV_M = {"fp8": 2, "nvfp4": 4}
MAX_M = 32  # the most rows a GEMV launch takes (the bench times it beside the tl.dot kernels up to here)
MAX_PER_THREAD = 512  # products per thread and K step (BLOCK_M*BLOCK_N*BLOCK_K / threads): no spills on sm90

# (BLOCK_N, BLOCK_K, num_warps, programs per SM, stages); BLOCK_K counts codes (NVFP4: 2 per byte).
# stages 1: plain loads, latency hidden by resident programs; > 1: the loop's loads run that many
# steps ahead through shared memory (cp.async). The first fitting entry is the default.
FP8_CONFIGS = ((64, 128, 4, 4, 1), (64, 128, 4, 4, 3), (32, 256, 4, 8, 1), (128, 128, 8, 2, 3), (16, 512, 4, 8, 1),
               (16, 128, 4, 8, 3), (8, 128, 4, 8, 1))
NVFP4_CONFIGS = ((32, 256, 4, 4, 1), (32, 256, 4, 4, 3), (64, 256, 8, 4, 3), (16, 256, 4, 8, 1), (8, 1024, 4, 8, 1),
                 (16, 128, 4, 8, 3), (8, 128, 4, 8, 1))
_CHOSEN: dict[tuple, tuple] = {}


@triton.jit
def _fp8_gemv_kernel(x_ptr, sxm, w_ptr, ws_ptr, swsn, bias_ptr, o_ptr, p_ptr, cnt_ptr, M, N, K, K_PER_SPLIT,
                     HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Rows rn of x @ dequant(w)^T over this split's K range. Tiles are [x rows, K chunks, W rows,
    16 codes]: a thread's 16 codes are one 16-byte load and their products are summed in the thread;
    the block scale (a chunk lies in one 128-column block) multiplies each chunk's sum, and the chunk
    partials are summed across threads once, after the loop."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    KT: tl.constexpr = BLOCK_K // 16
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, KT)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [KT, 16] column within the step
    mm = rm < M
    mn = rn < N
    # x is loaded as [rows, KT, 16] and broadcast over W rows (a 4-D load would set the layout of the product)
    x_rows = x_ptr + rm.to(tl.int64)[:, None, None] * sxm
    w_rows = w_ptr + rn.to(tl.int64)[None, None, :, None] * K
    s_rows = ws_ptr + ((rn // 128) * swsn)[None, :]
    rs = tl.arange(0, KT)[:, None] * 16  # [KT, 1] first column of a chunk
    acc = tl.zeros((BLOCK_M, KT, BLOCK_N), dtype=tl.float32)
    k0 = pid_s * K_PER_SPLIT
    k1 = tl.minimum(k0 + K_PER_SPLIT, K)
    for kk in tl.range(k0, k1, BLOCK_K, num_stages=STAGES):
        k = kk + rc
        kw = k[None, :, None, :]
        w = tl.load(w_rows + kw, mask=mn[None, None, :, None] & (kw < K), other=0.0).to(tl.float32)
        x = tl.load(x_rows + k[None], mask=mm[:, None, None] & (k < K)[None], other=0.0).to(tl.float32)
        s = tl.load(s_rows + (kk + rs) // 128, mask=mn[None, :] & (kk + rs < K), other=0.0)  # [KT, BLOCK_N]
        acc += tl.sum(x[:, :, None, :] * w, axis=3) * s[None]
    epilogue(tl.sum(acc, axis=1), o_ptr, p_ptr, cnt_ptr, bias_ptr, rm, rn, M, N, pid_n, pid_s, tl.num_programs(1),
             HAS_BIAS, DIRECT)


@triton.jit
def _e2m1_pair(byte):
    """A byte of two e2m1 codes (uint32) -> their fp32 values / 2^14 (low nibble, high nibble). Both
    nibbles are placed in one word's 16-bit halves, and each s.ee.m becomes the fp16 s.000ee.m000000000
    there (two codes per integer op; the 2^14 of the exponent biases is folded into the group scale)."""
    q = (byte | (byte << 12)) & 0x000F000F
    v = ((q << 12) & 0x80008000) | ((q << 9) & 0x0E000E00)
    lo = (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, (v >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nvfp4_gemv_kernel(x_ptr, sxm, w_ptr, swn, s_ptr, ssn, gs_ptr, bias_ptr, o_ptr, p_ptr, cnt_ptr, M, N, K,
                       K_PER_SPLIT, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Rows rn of x @ dequant(w)^T over this split's K range (codes). Tiles are [x rows, scale groups,
    W rows, 8 bytes]: a thread's 8 bytes are one load and one scale group (16 codes); low nibbles
    multiply x's even columns, high nibbles the odd ones, summed in the thread, times the group scale."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    NG: tl.constexpr = BLOCK_K // 16
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.arange(0, NG)
    rb = rg[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NG, 8] byte within the step
    mm = rm < M
    mn = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None, None] * sxm
    w_rows = w_ptr + rn.to(tl.int64)[None, None, :, None] * swn
    s_rows = s_ptr + rn.to(tl.int64)[None, :] * ssn
    acc = tl.zeros((BLOCK_M, NG, BLOCK_N), dtype=tl.float32)
    k0 = pid_s * K_PER_SPLIT
    k1 = tl.minimum(k0 + K_PER_SPLIT, K)
    for kk in tl.range(k0, k1, BLOCK_K, num_stages=STAGES):
        b = kk // 2 + rb
        bw = b[None, :, None, :]
        byte = tl.load(w_rows + bw, mask=mn[None, None, :, None] & (bw < K // 2), other=0).to(tl.uint32)
        g = (kk // 16 + rg)[:, None]
        sc = tl.load(s_rows + g, mask=mn[None, :] & (g * 16 < K), other=0.0).to(tl.float32)  # [NG, BLOCK_N]
        mx = mm[:, None, None] & (b < K // 2)[None]
        xe = tl.load(x_rows + 2 * b[None], mask=mx, other=0.0).to(tl.float32)  # [BLOCK_M, NG, 8]
        xo = tl.load(x_rows + 2 * b[None] + 1, mask=mx, other=0.0).to(tl.float32)
        lo, hi = _e2m1_pair(byte)
        # two sums, each a chain of FMAs (one sum of xe * lo + xo * hi adds its products separately)
        acc += (tl.sum(xe[:, :, None, :] * lo, axis=3) + tl.sum(xo[:, :, None, :] * hi, axis=3)) * sc[None]
    out = tl.sum(acc, axis=1) * (16384.0 / tl.load(gs_ptr))
    epilogue(out, o_ptr, p_ptr, cnt_ptr, bias_ptr, rm, rn, M, N, pid_n, pid_s, tl.num_programs(1), HAS_BIAS, DIRECT)


def row_bucket(m: int) -> int:
    """BLOCK_M: M rounded up to a power of 2 (the rows above M are masked)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"qgemv: the GEMV kernels take 1..{MAX_M} rows, got M={m}")
    return triton.next_power_of_2(m)


def candidates(kind: str, bm: int) -> list[tuple]:
    """The table's configs whose per-thread product (registers) fits for BLOCK_M = bm, in table order."""
    table = FP8_CONFIGS if kind == "fp8" else NVFP4_CONFIGS
    return [c for c in table if bm * c[0] * c[1] <= MAX_PER_THREAD * 32 * c[2]]


def plan(cfg: tuple, device: torch.device, n: int, k: int) -> tuple[int, int]:
    """(splits, K per split) of a config: enough programs for ``per_sm`` per SM, at least 2 K steps
    per split (the partials stay a small fraction of the weight bytes), splits on K-step bounds."""
    bn, bk, _, per_sm, _ = cfg
    steps = triton.cdiv(k, bk)
    tiles = triton.cdiv(n, bn)
    split = max(1, min(triton.cdiv(per_sm * sm_count(device), tiles), steps // 2 if steps >= 4 else 1))
    per = triton.cdiv(steps, split)
    return triton.cdiv(steps, per), per * bk


def _launch(kind: str, cfg: tuple, x2, wargs: tuple, bias, out_dtype):
    m, k = x2.shape
    n = wargs[0].shape[0]
    bn, bk, warps, _, stages = cfg
    split, kper = plan(cfg, x2.device, n, k)
    tiles = triton.cdiv(n, bn)
    out, partial, cnt = split_buffers(m, n, split, tiles, out_dtype, x2.device)
    common = dict(HAS_BIAS=bias is not None, DIRECT=split == 1, BLOCK_M=row_bucket(m), BLOCK_N=bn, BLOCK_K=bk,
                  STAGES=stages, num_warps=warps, num_stages=stages)
    b = bias if bias is not None else out
    if kind == "fp8":
        w, s = wargs
        _fp8_gemv_kernel[(tiles, split)](x2, x2.stride(0), w, s, s.stride(0), b, out, partial, cnt, m, n, k, kper,
                                         **common)
    else:
        p, sc, gs = wargs
        _nvfp4_gemv_kernel[(tiles, split)](x2, x2.stride(0), p, p.stride(0), sc, sc.stride(0), gs, b, out, partial,
                                           cnt, m, n, k, kper, **common)
    return out


def _time_configs(kind: str, cands: list[tuple], x2, wargs, bias, out_dtype) -> tuple:
    """The fastest config on this call's own tensors (after an L2 flush, so the weight comes from
    HBM as in a model); the first in table order within 3% of the fastest, so close timings do not
    flip the choice between processes. A config that fails to compile is skipped."""
    from ninfer.bench.kernel_timing import median_us
    try:
        buf = torch.empty(64 << 20, dtype=torch.int32, device=x2.device)
    except torch.cuda.OutOfMemoryError:  # a full device (e.g. the KV pool is allocated): the default
        log.warning("qgemv: no memory for the L2 flush of the config timing; %s keeps %s", kind, cands[0])
        return cands[0]
    times = []
    for cfg in cands:
        try:
            times.append((median_us(lambda: _launch(kind, cfg, x2, wargs, bias, out_dtype), 5,
                                    flush=lambda: buf.sum()), cfg))
        except Exception as e:  # noqa: BLE001 (a Triton compile or resource error of one config)
            log.warning("qgemv %s config %s failed (%s: %s); skipped", kind, cfg, type(e).__name__, str(e)[:200])
    if not times:
        raise RuntimeError(f"qgemv: no {kind} GEMV config ran on {x2.device}")
    best = min(t for t, _ in times)
    return next(cfg for t, cfg in times if t <= best * 1.03)


def config(kind: str, x2, wargs: tuple, bias, out_dtype) -> tuple:
    """The config of (device, row bucket, N, K): timed on first use on a GPU, kept for the process."""
    m, k = x2.shape
    n = wargs[0].shape[0]
    bm = row_bucket(m)
    cands = candidates(kind, bm)
    if x2.device.type != "cuda":
        return cands[0]
    idx = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    key = (kind, idx, bm, n, k)
    if key not in _CHOSEN:
        capturing = torch.cuda.is_current_stream_capturing()
        _CHOSEN[key] = cands[0] if capturing else _time_configs(kind, cands, x2, wargs, bias, out_dtype)
    return _CHOSEN[key]


def chosen(kind: str, device: torch.device, m: int, n: int, k: int) -> tuple | None:
    """The config a GEMV of this shape uses (None before its first call); for the bench's report."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _CHOSEN.get((kind, idx, row_bucket(m), n, k))


def fp8_gemv(x2, weight, wsi, bias, out_dtype, cfg: tuple | None = None):
    """x2 [M, K] @ dequant(weight [N, K] e4m3, wsi [N/128, K/128])^T (+ bias), checked inputs."""
    cfg = cfg or config("fp8", x2, (weight, wsi), bias, out_dtype)
    return _launch("fp8", cfg, x2, (weight, wsi), bias, out_dtype)


def nvfp4_gemv(x2, packed, scale, gs, bias, out_dtype, cfg: tuple | None = None):
    """x2 [M, K] @ dequant(packed [N, K/2], scale [N, K/16], gs)^T (+ bias), checked inputs."""
    cfg = cfg or config("nvfp4", x2, (packed, scale, gs), bias, out_dtype)
    return _launch("nvfp4", cfg, x2, (packed, scale, gs), bias, out_dtype)
