"""Paged decode attention (split-KV / flash-decoding) over the KV pool's planes, every format.

One program per (sequence, KV head, split) handles the whole GQA group of query rows as the small
dimension of ``tl.dot``, so every K/V byte is read once per step and shared by the group. K is
the A operand (tokens are the long M dimension, no transpose of the big tile). One page (64
tokens) is one tile. The grid is ``(B, Hkv, num_splits)`` with ``num_splits`` fixed from the GPU's
SM count and the page-table width (never from this step's lengths), so decode can be captured in a
CUDA graph; each program derives its page range from the device-side ``seq_lens``.

Formats (``docs/ARCHITECTURE.md`` "4-bit data layout" and "KV pool"):

* ``auto`` / ``bf16``: K/V tiles go straight into ``tl.dot``.
* ``int8``: per 64-group batched dots; the K group scale multiplies the group's partial score, the
  V group scale is folded into P (``P_g = P * s_v[:, g]``), so the int8 -> fp16 conversion is the
  only element-wise work.
* ``rk4v4`` / ``rk4v4-e8`` (H64-rotated): Q is rotated (and permuted, see below) in the program by
  one small exact dot with H64; scores are unchanged by the rotation. The packed bytes of group g
  are used as they are: low nibbles and high nibbles are two [T, 32] operands whose columns map to
  rotated dimensions ``16b + w`` and ``16b + 8 + w`` (byte ``4w + b``), and Q is permuted to match,
  so there is no re-interleaving of the tile. Offset-binary nibbles u = n + 8 enter the dot as
  they are; the ``-8`` folds into ``-8 * sum(q)`` (K) and ``-8 * sum(P)`` (V).
  For rk4v4-e8 the lattice work stays out of the element path: per 32-bit word (one E8 block)
  ``c`` = coset bit, ``par`` = parity of n0..n6, and ``q.p = q.n_stored + (par - c) q_7 + (c/2)
  sum_block q`` -- two per-word features against per-word Q weights in one extra K=16 dot. V gets
  the same features (``sum_t P (par - c)`` to the dimension of nibble 7, ``sum_t P c/2`` to all 8
  dimensions of the word), added once per split.
  The partial outputs stay in the H64 domain; ``decode_reduce`` undoes the rotation once (the CUDA
  kernel instead rotates each split's partial back in its epilogue, so its merge is a plain one).

Implementations: ``paged_decode_triton`` is the portable path (its kernel: paged_decode_kernel.py).
On NVIDIA GPUs (sm_80+, with nvcc or NVRTC) the int8 / rk4v4 / rk4v4-e8 formats also have a CUDA
C++ split kernel, ``paged_decode_cuda`` (paged_decode_cuda.py, source in csrc/paged_decode.cu),
several times faster than the Triton one at 128K (docs/BENCHMARKS.md "Kernels"). Which one serves
an engine is decided once at startup (ninfer/attention/selector.py). Both write split partials
merged by ``decode_reduce``.

``paged_decode_ref`` (bottom) is the independent torch oracle: it decodes the planes with the
format registry's reference decode (``ninfer.kvcache.formats``) and attends in float64.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

import torch
import triton

from ninfer.kernels.decode_reduce import decode_reduce
from ninfer.kernels.paged_decode_kernel import _e8_features, _paged_decode_split_kernel  # noqa: F401
from ninfer.kvcache.formats import GROUP, KVFormat

from ninfer.kernels._common import (FMT_E8, FMT_INT8, FMT_PLAIN, FMT_RK4, LOG2E,  # noqa: F401
                                    SM_COUNT as _SM_COUNT, kernel_code)
from ninfer.kernels.paged_decode_cuda import (_CUDA, _CUDA_SRC, default_cfg,  # noqa: F401
                                              _paged_decode_cuda_split, cuda_kernel_info, cuda_num_splits,
                                              cuda_path_supported)


# ----------------------------------------------------------------------------- host side


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs to fill the GPU about twice, from the SM count
    and the page-table width only (both fixed for a captured graph), at most one split per page."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        target = 2 * _SM_COUNT[idx]
    else:
        target = 4
    s = triton.cdiv(target, max(1, batch * num_kv_heads))
    return int(max(1, min(s, max_pages, 512)))


def _planes(planes, fmt, which: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(planes, torch.Tensor):
        data, sc = planes, None
    elif isinstance(planes, dict):
        data, sc = planes[which], planes.get(f"{which}_scale")
    else:
        seq = tuple(planes)
        data, sc = seq[0], (seq[1] if len(seq) > 1 else None)
    if fmt.has_scales and sc is None:
        raise ValueError(f"paged_decode: kv_dtype={fmt.name} needs the {which}_scale plane")
    return data, sc


def _check_plane(name: str, t: torch.Tensor, dtype, hkv: int, extent: int, page: int | None, device) -> None:
    if t.dim() != 4 or t.shape[1] != hkv or t.shape[3] != extent or (page is not None and t.shape[2] != page):
        raise ValueError(f"paged_decode: plane {name} is {list(t.shape)}, expected [pages, {hkv}, "
                         f"{page if page is not None else 'page'}, {extent}]")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"paged_decode: plane {name} is {t.dtype}, the format stores {dtype}")
    if t.stride(3) != 1:
        raise ValueError(f"paged_decode: plane {name} needs a contiguous last dim, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"paged_decode: plane {name} on {t.device}, q on {device}")


def _checked_decode_args(q, k_planes, v_planes, block_tables, seq_lens, fmt, out):
    """The checks both decode implementations share -> (code, kd, ks, vd, vs, seq_lens, out)."""
    code = kernel_code(fmt, "paged_decode")
    if q.dim() != 3 or not q.is_floating_point() or q.stride(2) != 1:
        raise ValueError(f"paged_decode: q must be a float [B, Hq, D] with contiguous last dim, got "
                         f"{q.dtype}{list(q.shape)} strides {q.stride()}")
    bsz, hq, d = q.shape
    kd, ks = _planes(k_planes, fmt, "k")
    vd, vs = _planes(v_planes, fmt, "v")
    hkv, page = kd.shape[1], kd.shape[2]
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"paged_decode: Hq={hq} is not a multiple of Hkv={hkv}")
    if code != FMT_PLAIN and d % GROUP:
        raise ValueError(f"paged_decode: kv_dtype={fmt.name} needs head_dim % 64 == 0, got {d}")
    if page < 16 or page & (page - 1):
        raise ValueError(f"paged_decode: page size must be a power of 2 >= 16, got {page}")
    data_dt = None if code == FMT_PLAIN else fmt.data_dtype()
    if code == FMT_PLAIN and not kd.is_floating_point():
        raise ValueError(f"paged_decode: kv_dtype={fmt.name} planes must be float, got {kd.dtype}")
    if fmt.storage is not None and code == FMT_PLAIN:
        data_dt = fmt.storage
    ext = fmt.data_extent(d)
    _check_plane("k", kd, data_dt, hkv, ext, page, q.device)
    _check_plane("v", vd, kd.dtype, hkv, ext, page, q.device)
    if vd.shape[0] != kd.shape[0]:
        raise ValueError(f"paged_decode: k/v planes have {kd.shape[0]}/{vd.shape[0]} pages")
    g = d // GROUP
    if fmt.has_scales:
        _check_plane("k_scale", ks, torch.float16, hkv, g, page, q.device)
        _check_plane("v_scale", vs, torch.float16, hkv, g, page, q.device)
    else:
        ks, vs = kd, vd
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or block_tables.dtype != torch.int32:
        raise ValueError(f"paged_decode: block_tables must be int32 [{bsz}, max_pages], got "
                         f"{block_tables.dtype}{list(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("paged_decode: block_tables needs a contiguous last dim")
    if seq_lens.shape != (bsz,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"paged_decode: seq_lens must be int32 [{bsz}], got {seq_lens.dtype}{list(seq_lens.shape)}")
    if block_tables.device != q.device or seq_lens.device != q.device:
        raise ValueError("paged_decode: q, block_tables and seq_lens must be on one device")
    if seq_lens.stride(0) != 1:
        seq_lens = seq_lens.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"paged_decode: out must be contiguous {q.dtype}{list(q.shape)}")
    return code, kd, ks, vd, vs, seq_lens, out


def _splits(num_splits: int) -> int:
    if int(num_splits) < 1:
        raise ValueError(f"paged_decode: num_splits must be >= 1, got {num_splits}")
    return int(num_splits)


def paged_decode_triton(q: torch.Tensor, k_planes, v_planes, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        fmt: KVFormat, scale: float, *, num_splits: int | None = None,
                        out: torch.Tensor | None = None, num_warps: int = 4,
                        tail=None) -> torch.Tensor:
    """Decode attention of one new query token per sequence over its paged, cached K/V (Triton kernel).

    Parameters
    ----------
    q : [B, Hq, D] float (bf16/fp16/fp32), last dim contiguous; not rotated (rotated formats
        rotate it inside the kernel).
    k_planes, v_planes : the layer's planes, ``(data, scale)`` (scale ``None`` or omitted for
        unscaled formats) or the pool's dict (``{"k", "k_scale", ...}``); data
        ``[num_pages, Hkv, page, extent]`` in the format's dtype, scale fp16 ``[num_pages, Hkv, page, D/64]``.
    block_tables : int32 [B, max_pages], page ids per sequence (entries past the sequence are ignored).
    seq_lens : int32 [B], cached tokens per sequence including the new one (0 gives zeros).
    fmt : the ``ninfer.kvcache.formats`` format object (one with a ``kernel_code``).
    scale : softmax scale (usually D ** -0.5).
    num_splits : splits per (sequence, KV head); default ``default_num_splits`` (the SM count, B, Hkv
        and ``max_pages`` only, never ``seq_lens``), so one value serves a captured graph.
    out : optional [B, Hq, D] output buffer (q's dtype).
    num_warps : tuning knob for the benchmark.
    tail : a ``window_attn.WindowTail`` (rk4v4-e8w): the ring's newest positions, merged with the splits
        by ``decode_reduce`` (``seq_lens`` then ends where the window starts).

    Returns
    -------
    out : [B, Hq, D] in q's dtype, in the natural (unrotated) basis.
    """
    code, kd, ks, vd, vs, seq_lens, out = _checked_decode_args(q, k_planes, v_planes, block_tables, seq_lens,
                                                               fmt, out)
    bsz, hq, d = q.shape
    hkv, page = kd.shape[1], kd.shape[2]
    if bsz == 0:
        return out
    splits = _splits(num_splits if num_splits is not None else
                     default_num_splits(bsz, hkv, block_tables.shape[1], q.device))
    mid_o = torch.empty(bsz * hq, splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bsz * hq, splits, dtype=torch.float32, device=q.device)
    # Packed formats also read their bytes as little-endian 32-bit words (one E8 block each).
    if code in (FMT_RK4, FMT_E8):
        kw, vw = kd.view(torch.int32), vd.view(torch.int32)
    else:
        kw, vw = kd, vd
    g = d // GROUP
    group = hq // hkv
    block_m = max(16, triton.next_power_of_2(group))
    block_g = triton.next_power_of_2(max(1, g))
    _paged_decode_split_kernel[(bsz, hkv, splits)](
        q, kd, kw, ks, vd, vw, vs, block_tables, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        kd.stride(0), kd.stride(1), kd.stride(2), kw.stride(0), kw.stride(1), kw.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vd.stride(0), vd.stride(1), vd.stride(2), vw.stride(0), vw.stride(1), vw.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        block_tables.stride(0), mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0),
        float(scale) * LOG2E, splits,
        HQ=hq, GROUP_SIZE=group, BLOCK_M=block_m, D=d, BLOCK_D=triton.next_power_of_2(d),
        G=g, BLOCK_G=block_g, FMT=code, PAGE=page, INTERPRET=_interpreting(), num_warps=num_warps)
    decode_reduce(mid_o, mid_lse, out.view(bsz * hq, d), rotated=fmt.rotated, tail=tail)
    return out


def paged_decode_cuda(q: torch.Tensor, k_planes, v_planes, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      fmt: KVFormat, scale: float, *, num_splits: int | None = None,
                      out: torch.Tensor | None = None, cuda_cfg: tuple[int, ...] | None = None,
                      tail=None) -> torch.Tensor:
    """``paged_decode_triton``'s contract on the CUDA C++ split kernel (int8/rk4v4/rk4v4-e8, head_dim
    128/256, GQA group <= 8, page 64, sm_80+); ValueError where it cannot run. Default splits:
    ``cuda_num_splits`` (one wave of resident blocks). cuda_cfg: (warps, chunk, stages[, min blocks
    per SM]), a benchmark knob. tail: as for ``paged_decode_triton``, but computed by ``window_partial``
    on a second stream while the split kernel runs (graph-capturable: the streams fork and join by
    events): the split kernel fills one wave of blocks, and the window's small programs fit beside it,
    where inside the reduction they would add their latency to the step (docs/KERNELS.md)."""
    code, kd, ks, vd, vs, seq_lens, out = _checked_decode_args(q, k_planes, v_planes, block_tables, seq_lens,
                                                               fmt, out)
    bsz, hq, d = q.shape
    why = cuda_path_supported(q, kd, fmt)
    if why is None and not all(t.is_contiguous() for t in (kd, vd, ks, vs)):
        why = "planes not contiguous"
    if why is not None:
        raise ValueError(f"paged_decode_cuda: {why}")
    if bsz == 0:
        return out
    cfg = cuda_cfg or default_cfg(code, d)
    splits = _splits(num_splits if num_splits is not None else
                     cuda_num_splits(bsz, kd.shape[1], block_tables.shape[1], q.device, fmt, d, q.dtype, cfg))
    mid_o = torch.empty(bsz * hq, splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bsz * hq, splits, dtype=torch.float32, device=q.device)
    partial = None
    if tail is not None:
        from ninfer.kernels.window_attn import window_partial
        cur, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            partial = window_partial(tail)
    _paged_decode_cuda_split(q, kd, ks, vd, vs, block_tables, seq_lens, mid_o, mid_lse, code, scale, splits, cfg)
    if partial is not None:
        cur.wait_stream(side)
        for t in partial:  # allocated on the side stream, read and freed on this one
            t.record_stream(cur)
    # the CUDA kernel rotates each split's partial back itself (in its epilogue, in parallel)
    decode_reduce(mid_o, mid_lse, out.view(bsz * hq, d), rotated=False, partial=partial)
    return out


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(idx)
    return _SIDE[idx]


# ----------------------------------------------------------------------------- torch reference
def paged_decode_ref(q: torch.Tensor, k_planes, v_planes, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     fmt: KVFormat, scale: float) -> torch.Tensor:
    """Oracle for ``paged_decode_triton`` / ``paged_decode_cuda``: gathers each sequence's pages, decodes
    them with the format's reference decode (natural basis) and attends in float64, on the inputs' device.
    Returns float32 [B, Hq, D] (zeros for an empty sequence)."""
    kd, ks = _planes(k_planes, fmt, "k")
    vd, vs = _planes(v_planes, fmt, "v")
    bsz, hq, d = q.shape
    hkv, page = kd.shape[1], kd.shape[2]
    grp = hq // hkv
    dev = kd.device
    out = torch.zeros(bsz, hq, d, dtype=torch.float64, device=dev)
    lens = seq_lens.cpu().tolist()
    bt = block_tables.cpu()
    for b in range(bsz):
        n = int(lens[b])
        if n == 0:
            continue
        pages = bt[b, : math.ceil(n / page)].long().to(dev)

        def gather(t):
            x = t[pages]  # [n_pages, Hkv, page, ext]
            return x.permute(1, 0, 2, 3).reshape(hkv, -1, x.shape[-1])[:, :n]

        if fmt.has_scales:
            k = fmt.decode(gather(kd), gather(ks), rotated=False, dtype=torch.float64)
            v = fmt.decode(gather(vd), gather(vs), rotated=False, dtype=torch.float64)
        else:
            k, v = gather(kd).to(torch.float64), gather(vd).to(torch.float64)
        qb = q[b].detach().to(device=dev, dtype=torch.float64).reshape(hkv, grp, d)
        s = torch.einsum("hgd,hnd->hgn", qb, k) * float(scale)
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hgn,hnd->hgd", p, v).reshape(hq, d)
    return out.to(torch.float32)


__all__: Sequence[str] = ("paged_decode_triton", "paged_decode_cuda", "paged_decode_ref", "default_num_splits",
                          "cuda_num_splits", "cuda_path_supported", "cuda_kernel_info")
