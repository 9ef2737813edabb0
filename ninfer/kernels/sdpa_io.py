"""The layout passes around torch SDPA in the prefill path (ninfer/attention/prefill_sdpa.py).

``fold_q``: q [Tq, Hq, D] (natural order) -> [Hq, Tq, D] in the workspace dtype, head-major, which
is also the GQA-folded layout [Hkv, g * Tq, D]; for the rotated formats each 64-group is rotated
into the stored domain on the way (``x @ R`` by the Walsh-Hadamard butterfly in float32, then the
word order of ``ninfer/kernels/hadamard.py``: one 8x8 transpose per group).

``merge_out``: one or two partial attention results with their log-sum-exps -> the merged output,
rotated back (transpose, then the butterfly: R is its own inverse), cast and written in place into
out [Tq, Hq, D]. A partial is addressed per query head h and token t as
``(h // g) * A + (h % g) * B + t * C`` so both the folded [Hkv, g * Tq, D] and the per-head
[Hq, Tq, D] SDPA outputs are read where they lie.

Why kernels: in torch these were several passes over [Tq, Hq, D] in float32, and the rotation's
``[..., G, 64] @ [64, 64]`` ran as a batched GEMV (H200, 2026-12-01: 3.6 ms per 8192-token chunk
at 32 heads x D128, more than the cached attention of a 32K context).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.kernels.hadamard import from_word_domain, rotate_rows_fwht, to_word_domain

BLOCK_T = 32


def _interpreting() -> bool:
    """Under TRITON_INTERPRET=1 float32 -> bf16 casts truncate: such outputs go through a float32
    buffer and a torch cast there, so the interpreter computes what the GPU does."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _word_transpose(x, ROWS: tl.constexpr):
    """Per 64-group, element 8a + b <-> 8b + a (natural rotated order <-> word order)."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, 8, 8)), (0, 2, 1)), (ROWS, 64))


@triton.jit
def _fold_q_kernel(q, sq_t, sq_h, qf, T, D: tl.constexpr, BT: tl.constexpr, ROT: tl.constexpr):
    h = tl.program_id(1)
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = (t < T)[:, None]
    d = tl.arange(0, D)[None, :]
    x = tl.load(q + t[:, None] * sq_t + h * sq_h + d, mask=tm, other=0).to(tl.float32)
    if ROT:
        R: tl.constexpr = BT * (D // 64)
        x = tl.reshape(_word_transpose(rotate_rows_fwht(tl.reshape(x, (R, 64))), R), (BT, D))
    tl.store(qf + (h * T + t[:, None]) * D + d, x.to(qf.dtype.element_ty), mask=tm)


@triton.jit
def _merge_out_kernel(o1, l1, A1, B1, C1, LA1, LB1, LC1, o2, l2, A2, B2, C2, LA2, LB2, LC2,
                      out, so_t, so_h, T, GQA, D: tl.constexpr, BT: tl.constexpr, TWO: tl.constexpr,
                      ROT: tl.constexpr):
    h = tl.program_id(1)
    kv = h // GQA
    gi = h % GQA
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    d = tl.arange(0, D)[None, :]
    x = tl.load(o1 + kv * A1 + gi * B1 + t[:, None] * C1 + d, mask=tm[:, None], other=0).to(tl.float32)
    if TWO:
        a = tl.load(l1 + kv * LA1 + gi * LB1 + t * LC1, mask=tm, other=0)
        b = tl.load(l2 + kv * LA2 + gi * LB2 + t * LC2, mask=tm, other=0)
        y = tl.load(o2 + kv * A2 + gi * B2 + t[:, None] * C2 + d, mask=tm[:, None], other=0).to(tl.float32)
        m = tl.maximum(a, b)
        wa = tl.exp(a - m)
        wb = tl.exp(b - m)
        x = (x * wa[:, None] + y * wb[:, None]) / (wa + wb)[:, None]
    if ROT:
        R: tl.constexpr = BT * (D // 64)
        x = tl.reshape(rotate_rows_fwht(_word_transpose(tl.reshape(x, (R, 64)), R)), (BT, D))
    tl.store(out + t[:, None] * so_t + h * so_h + d, x.to(out.dtype.element_ty), mask=tm[:, None])


def fold_q(q: torch.Tensor, rotate: bool, dtype: torch.dtype) -> torch.Tensor:
    """q [Tq, Hq, D] (last dim contiguous) -> [Hq, Tq, D] of ``dtype``, rotated to word order if asked."""
    t, hq, d = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    interp = _interpreting() and dtype != torch.float32
    qf = torch.empty(hq, t, d, dtype=torch.float32 if interp else dtype, device=q.device)
    if t:
        _fold_q_kernel[(triton.cdiv(t, BLOCK_T), hq)](q, q.stride(0), q.stride(1), qf, t, D=d, BT=BLOCK_T,
                                                      ROT=rotate, num_warps=4)
    return qf.to(dtype) if interp else qf


def _addr(o: torch.Tensor, lse: torch.Tensor, folded: bool, g: int, t: int) -> tuple:
    """(A, B, C) of o [H, L, D] and of lse [H, L]: folded = [Hkv, g * Tq] rows, else [Hq, Tq]."""
    if o.stride(2) != 1:
        raise ValueError("merge_out: partial outputs need a contiguous last dim")
    if folded:
        return (o.stride(0), t * o.stride(1), o.stride(1)), (lse.stride(0), t * lse.stride(1), lse.stride(1))
    return (g * o.stride(0), o.stride(0), o.stride(1)), (g * lse.stride(0), lse.stride(0), lse.stride(1))


def merge_out(parts: list[tuple[torch.Tensor, torch.Tensor, bool]], out: torch.Tensor, gqa: int,
              rotate: bool) -> None:
    """Merge one or two partials (o [H, L, D], lse float32 [H, L], folded) into out [Tq, Hq, D]."""
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"merge_out takes one or two partials, got {len(parts)}")
    t, hq, d = out.shape
    if out.stride(2) != 1:
        raise ValueError("merge_out: out needs a contiguous last dim")
    if t == 0:
        return
    args = []
    for o, lse, folded in parts + parts[:1] * (2 - len(parts)):
        (a, b, c), (la, lb, lc) = _addr(o, lse, folded, gqa, t)
        args += [o, lse, a, b, c, la, lb, lc]
    dst = torch.empty(out.shape, dtype=torch.float32, device=out.device) \
        if _interpreting() and out.dtype != torch.float32 else out
    _merge_out_kernel[(triton.cdiv(t, BLOCK_T), hq)](*args, dst, dst.stride(0), dst.stride(1), t, gqa, D=d,
                                                     BT=BLOCK_T, TWO=len(parts) == 2, ROT=rotate, num_warps=4)
    if dst is not out:
        out.copy_(dst)


# ----------------------------------------------------------------------------- torch oracles
def fold_q_ref(q: torch.Tensor, rotate: bool, dtype: torch.dtype) -> torch.Tensor:
    x = to_word_domain(q) if rotate else q.to(torch.float32)
    return x.permute(1, 0, 2).to(dtype).contiguous()


def _per_head(o: torch.Tensor, folded: bool, g: int, t: int) -> torch.Tensor:
    """A partial [H, L, ...] as [Hq, Tq, ...] (the folded rows gi * Tq + i are head kv * g + gi)."""
    return o.reshape(o.shape[0] * g, t, *o.shape[2:]) if folded else o


def merge_out_ref(parts: list[tuple[torch.Tensor, torch.Tensor, bool]], out: torch.Tensor, gqa: int,
                  rotate: bool) -> None:
    t = out.shape[0]
    os_ = [_per_head(o, f, gqa, t).to(torch.float64) for o, _, f in parts]
    ls = [_per_head(lse, f, gqa, t).to(torch.float64) for _, lse, f in parts]
    m = torch.stack(ls).amax(0)
    w = [torch.exp(x - m) for x in ls]
    x = sum(o * wi[..., None] for o, wi in zip(os_, w)) / sum(w)[..., None]
    x = x.permute(1, 0, 2)
    out.copy_((from_word_domain(x) if rotate else x).to(out.dtype))
