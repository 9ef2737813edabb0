"""Dequantize a token range of one sequence's KV pages into a dense workspace (every format).

The tensor-core prefill path (``ninfer/attention/prefill_sdpa.py``) attends with torch SDPA over
dense K/V; this is its one memory-bound pass: read the packed pages of tokens [tok0, tok0 + n)
through the block table, write K and V as ``[Hkv, n, D]`` in the workspace dtype (bf16 or fp16).

Values are ``code * scale`` computed in float32 (exact: a 4-bit code has at most 5 significant
bits, an int8 code 7, an fp16 scale 11) and rounded once to the workspace dtype.

The rotated formats are NOT un-rotated: each E8 word unpacks to 8 coordinates, so a row comes out
in the *word order* of ``ninfer/kernels/hadamard.py`` (element 64g + 8w + j is rotated coordinate
64g + 8j + w). The caller rotates Q into the same domain once (``to_word_domain``; scores are
unchanged since the rotation is orthonormal) and the output back once (``from_word_domain``).
int8 and the unquantized formats come out in natural order.

Interpreter note: under ``TRITON_INTERPRET=1`` the float32 -> bf16 cast truncates instead of
rounding to nearest even, so the wrapper writes a float32 buffer there and torch casts it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.kernels._common import FMT_E8, FMT_RK4, kernel_code
from ninfer.kvcache.formats import KVFormat, get_format


@triton.jit
def _plane_tile(data_ptr, scale_ptr, row, tm, FMT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, D] float32 (or the plane dtype for the copy formats) of the rows ``row``."""
    G: tl.constexpr = D // 64
    if FMT == 0:
        d = tl.arange(0, D)
        x = tl.load(data_ptr + row[:, None] * D + d[None, :], mask=tm[:, None], other=0)
    elif FMT == 1:
        d = tl.arange(0, D)
        x = tl.load(data_ptr + row[:, None] * D + d[None, :], mask=tm[:, None], other=0).to(tl.float32)
        s = tl.load(scale_ptr + row[:, None] * G + tl.arange(0, G)[None, :], mask=tm[:, None], other=0)
        x = tl.reshape(tl.reshape(x, (BLOCK_N, G, 64)) * s.to(tl.float32)[:, :, None], (BLOCK_N, D))
    else:
        DW: tl.constexpr = D // 8  # int32 words (E8 blocks) per row
        w = tl.arange(0, DW)
        W = tl.load(data_ptr + row[:, None] * DW + w[None, :], mask=tm[:, None], other=0)
        s = tl.load(scale_ptr + row[:, None] * G + (w // 8)[None, :], mask=tm[:, None], other=0).to(tl.float32)
        half = tl.zeros_like(s)
        n7 = ((W >> 28) & 15).to(tl.float32) - 8.0
        if FMT == 3:
            c = (W >> 28) & 1
            par = W & 0x01111111  # low bits of nibbles 0..6
            par = par ^ (par >> 16)
            par = par ^ (par >> 8)
            par = par ^ (par >> 4)
            half = c.to(tl.float32) * 0.5  # p = n + c/2
            # nibble 7 stored c in its low bit; its true low bit is the parity of nibbles 0..6
            n7 = ((((W >> 28) & 14) | (par & 1)).to(tl.float32) - 8.0) + half
        v0 = ((((W >> 0) & 15).to(tl.float32) - 8.0) + half) * s
        v1 = ((((W >> 4) & 15).to(tl.float32) - 8.0) + half) * s
        v2 = ((((W >> 8) & 15).to(tl.float32) - 8.0) + half) * s
        v3 = ((((W >> 12) & 15).to(tl.float32) - 8.0) + half) * s
        v4 = ((((W >> 16) & 15).to(tl.float32) - 8.0) + half) * s
        v5 = ((((W >> 20) & 15).to(tl.float32) - 8.0) + half) * s
        v6 = ((((W >> 24) & 15).to(tl.float32) - 8.0) + half) * s
        v7 = n7 * s
        # join appends a last axis: [.., j2, j1, j0] with j = 4 j2 + 2 j1 + j0, so row index 8w + j
        x = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        x = tl.reshape(x, (BLOCK_N, D))
    return x


@triton.jit
def _dequant_kernel(kd, ks, vd, vs, bt_ptr, ko, vo, tok0, n, HKV, so_h,
                    FMT: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tm = t < n
    tt = tok0 + t
    page = tl.load(bt_ptr + tt // PAGE, mask=tm, other=0).to(tl.int64)
    row = (page * HKV + h) * PAGE + tt % PAGE
    dst = h.to(tl.int64) * so_h + t.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    k = _plane_tile(kd, ks, row, tm, FMT, D, BLOCK_N)
    tl.store(ko + dst, k.to(ko.dtype.element_ty), mask=tm[:, None])
    v = _plane_tile(vd, vs, row, tm, FMT, D, BLOCK_N)
    tl.store(vo + dst, v.to(vo.dtype.element_ty), mask=tm[:, None])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dequant_pages(planes: dict, fmt: KVFormat | str, block_table: torch.Tensor, tok0: int, n: int,
                  k_out: torch.Tensor, v_out: torch.Tensor, *, block_n: int = 64) -> None:
    """Write tokens [tok0, tok0 + n) of one sequence (``block_table`` [pages] int32, its row of the
    block table) as K/V values into ``k_out``/``v_out`` [Hkv, >= n, D] (rows 0..n-1; contiguous
    rows of D elements, bf16/fp16/fp32). Rotated formats in word order (module docstring)."""
    fmt = get_format(fmt)
    code = kernel_code(fmt, "dequant_pages")
    kd, vd = planes["k"], planes["v"]
    ks, vs = planes.get("k_scale"), planes.get("v_scale")
    _, hkv, page, _ = kd.shape
    d = k_out.shape[-1]
    if k_out.shape != v_out.shape or k_out.dim() != 3 or k_out.shape[0] != hkv or k_out.shape[1] < n:
        raise ValueError(f"dequant_pages: outputs {list(k_out.shape)}/{list(v_out.shape)} must be [{hkv}, >= {n}, D]")
    if k_out.stride(2) != 1 or k_out.stride(1) != d or v_out.stride() != k_out.stride():
        raise ValueError("dequant_pages: outputs must have contiguous rows of D elements, alike strides")
    if kd.shape[-1] != fmt.data_extent(d) or d & (d - 1) or d < 64:
        raise ValueError(f"dequant_pages: kv_dtype={fmt.name} planes of extent {kd.shape[-1]} for head_dim {d} "
                         f"(a power of 2 >= 64 here)")
    if n <= 0:
        return
    if ks is None:
        ks, vs = kd, vd  # unused by the unscaled variants
    if code in (FMT_RK4, FMT_E8):
        kd, vd = kd.view(torch.int32), vd.view(torch.int32)
    interp = _interpreting() and k_out.dtype != torch.float32
    ko = torch.empty(k_out.shape, dtype=torch.float32, device=k_out.device) if interp else k_out
    vo = torch.empty(v_out.shape, dtype=torch.float32, device=v_out.device) if interp else v_out
    grid = (triton.cdiv(n, block_n), hkv)
    _dequant_kernel[grid](kd, ks, vd, vs, block_table, ko, vo, int(tok0), int(n), hkv, ko.stride(0),
                          FMT=code, D=d, PAGE=page, BLOCK_N=block_n, num_warps=4)
    if interp:
        k_out[:, :n].copy_(ko[:, :n])
        v_out[:, :n].copy_(vo[:, :n])


def dequant_pages_ref(planes: dict, fmt: KVFormat | str, block_table: torch.Tensor, tok0: int, n: int,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of :func:`dequant_pages`: the format's reference decoder (rotated domain kept),
    permuted to word order for the rotated formats. Returns (K, V) [Hkv, n, D] in ``dtype``."""
    fmt = get_format(fmt)
    page = planes["k"].shape[2]
    tok = torch.arange(tok0, tok0 + n, device=block_table.device)
    pages = block_table.long()[tok // page]
    off = tok % page

    def rows(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[pages, :, off].transpose(0, 1)  # [Hkv, n, E]

    out = []
    for name in ("k", "v"):
        x = fmt.decode(rows(planes[name]), rows(planes.get(f"{name}_scale")), rotated=True, dtype=torch.float32)
        if fmt.rotated:
            e = torch.arange(64, device=x.device)
            x = x.reshape(*x.shape[:-1], -1, 64)[..., 8 * (e % 8) + e // 8].reshape(x.shape)
        out.append(x.to(dtype))
    return out[0], out[1]
