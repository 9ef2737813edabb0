"""Chunked-prefill attention over packed KV pages (every format), causal, varlen, GQA.

The new chunk has already been written to the pages by the store op, so every key is read
through the page table: one code path for the cached prefix and the chunk.

Grid ``(cdiv(max_query_len, BLOCK_T), B, Hkv)``, last query tiles first (they have the most
keys). A program owns BLOCK_T query tokens of one sequence and all GQA query heads of one KV
head (rows = token-major x padded group, BLOCK_M rows), so each K/V tile is dequantized once for
the whole group. It walks the sequence's keys in BLOCK_N-key tiles inside pages (long prompts
stream through in O(tile) memory): tiles wholly before its first query need no mask, the
diagonal ones are masked. Online softmax in base 2.

Tiles are dequantized to the dot dtype as ``s * code`` (fp16 for the scaled formats: 11 mantissa
bits, like the decode kernel; the plane dtype for unquantized ones; Q and P are cast to it too),
the way the int8 control does, so int8 and 4-bit share the structure and differ only in unpack:
* int8: natural dimension order, code -> fp16 by the 0x6400 exponent trick.
* rk4v4 / rk4v4-e8: one int32 load per E8 block (word); 8 shifts per word give the tile in
  *word order* (see ``hadamard.py``); rk4v4-e8 adds per-word terms ``c/2`` and, for nibble 7,
  ``parity(n0..n6) - c`` (computed per word, selected per element). Q is rotated into the same
  word-ordered rotated domain in the prologue and the output rotated back in the epilogue.

Interpreter note: Triton 3.6's interpreter computes bf16 ``tl.dot`` on the raw bit patterns and
does not round fp32->bf16 to nearest even, so under ``TRITON_INTERPRET=1`` the wrapper selects
float32 dot operands (``DOT_F32``) where they would be bf16, and a float32 output buffer (cast by
torch). fp16 dots (every scaled format) run as on the GPU.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ninfer.kernels.hadamard import rot64_word_order
from ninfer.kernels._common import FMT_E8, FMT_PLAIN as FMT_COPY, FMT_RK4, kernel_code
from ninfer.kvcache.formats import KVFormat
from ninfer.kvcache.hadamard import rotate

SCALE_BCAST = tl.constexpr(True)  # 4-bit tiles: load scales as [BLOCK_N, G] and broadcast (False: per-word gather)
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _nib(W, j: tl.constexpr, s, off, FMT: tl.constexpr):
    """Nibble j of every word as fp16 ``s * (u - 8 [+ off])`` (exact operands, one rounding)."""
    u = (((W >> (4 * j)) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + u
    n = u - 1032.0  # exact: u - 8 in [-8, 7]
    if FMT == 3:
        n = n + off
    return n * s


@triton.jit
def _kv_tile(data_ptr, scale_ptr, row0, FMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """Dequantized tile [BLOCK_N, BLOCK_D] of one KV head (plane rows row0 ...): the plane's own
    dtype for unquantized formats, fp16 ``s * code`` (one rounding, exact operands) otherwise.

    No int->float conversion per element (a slow-path instruction): a code c in [0, 255] is made
    an fp16 by OR-ing it into the mantissa of 1024 (0x6400 | c == 1024 + c exactly), then one
    exact fp16 subtraction and one fp16 multiply by the scale."""
    rows = row0 + tl.arange(0, BLOCK_N)
    G: tl.constexpr = D // 64
    if FMT == 0 or FMT == 1:
        d = tl.arange(0, BLOCK_D)
        if D == BLOCK_D:  # no mask: 16-byte vector loads / cp.async
            x = tl.load(data_ptr + rows[:, None] * D + d[None, :])
        else:
            x = tl.load(data_ptr + rows[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0)
        if FMT == 1:
            # One scale per (row, group): a [BLOCK_N, G] load broadcast over the group's 64 codes
            # (a per-element gather would issue one 2-byte load per code).
            s = tl.load(scale_ptr + rows[:, None] * G + tl.arange(0, G)[None, :])
            u = ((x.to(tl.int16) + 128) | 0x6400).to(tl.float16, bitcast=True)  # 1024 + 128 + code
            x = tl.reshape(tl.reshape(u - 1152.0, (BLOCK_N, G, 64)) * s[:, :, None], (BLOCK_N, D))
    else:
        DW: tl.constexpr = D // 8  # words (E8 blocks) per row; D is a power of two here
        w = tl.arange(0, DW)
        W = tl.load(data_ptr + rows[:, None] * DW + w[None, :])
        if SCALE_BCAST:  # [BLOCK_N, G] load, broadcast to the words of each group
            sg = tl.load(scale_ptr + rows[:, None] * G + tl.arange(0, G)[None, :])
            s = tl.reshape(tl.broadcast_to(sg[:, :, None], (BLOCK_N, G, 8)), (BLOCK_N, DW))
        else:
            s = tl.load(scale_ptr + rows[:, None] * G + w[None, :] // 8)  # fp16 [BLOCK_N, DW]
        half = s  # unused unless FMT == 3
        off7 = s
        if FMT == 3:
            c = (W >> 28) & 1
            par = W & 0x01111111  # low bits of nibbles 0..6
            par = par ^ (par >> 16)
            par = par ^ (par >> 8)
            par = par ^ (par >> 4)
            t = par & 1
            half = tl.where(c == 1, 0.5, 0.0).to(tl.float16)  # p = n + c/2
            # nibble 7 stored c in its low bit; its true low bit is t: add t - c
            off7 = (half + tl.where(t == c, 0.0, tl.where(t == 1, 1.0, -1.0))).to(tl.float16)
        # Per word, elementwise on [BLOCK_N, DW] (each thread converts whole words; no per-element
        # broadcast of the word across lanes), then the 8 nibble planes are joined in-thread.
        v0 = _nib(W, 0, s, half, FMT)
        v1 = _nib(W, 1, s, half, FMT)
        v2 = _nib(W, 2, s, half, FMT)
        v3 = _nib(W, 3, s, half, FMT)
        v4 = _nib(W, 4, s, half, FMT)
        v5 = _nib(W, 5, s, half, FMT)
        v6 = _nib(W, 6, s, half, FMT)
        v7 = _nib(W, 7, s, off7, FMT)
        # join appends a last axis: build [.., j2, j1, j0] with j = 4 j2 + 2 j1 + j0
        x = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        x = tl.reshape(x, (BLOCK_N, BLOCK_D))
    return x


@triton.jit
def _attend_page(acc, m_i, l_i, q, kd, ks, vd, vs, bt_row, i, h, HKV, qpos, seq_len, qk_scale,
                 MASK: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr):
    # KV tile i = rows [i * BLOCK_N, (i + 1) * BLOCK_N) of the sequence, inside one page.
    page = tl.maximum(tl.load(bt_row + i // (PAGE // BLOCK_N)), 0).to(tl.int64)
    row0 = (page * HKV + h) * PAGE + (i % (PAGE // BLOCK_N)) * BLOCK_N
    k = _kv_tile(kd, ks, row0, FMT, D, BLOCK_D, BLOCK_N).to(DT)
    s = _dot(q, tl.trans(k), DOT_F32) * qk_scale
    if MASK:
        kpos = i * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < seq_len)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _kv_tile(vd, vs, row0, FMT, D, BLOCK_D, BLOCK_N)
    if MASK:  # slots past the sequence end may hold anything (stale pages): p = 0 must not meet NaN
        v = tl.where((kpos < seq_len)[:, None], v, 0.0)
    v = v.to(DT)
    acc = acc * alpha[:, None] + _dot(p.to(DT), v, DOT_F32)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(q_ptr, sqt, sqh, kd, ks, vd, vs, o_ptr, sot, soh, qsl_ptr, seqlen_ptr, bt_ptr, sbt,
                    HKV, qk_scale,
                    FMT: tl.constexpr, ROTATED: tl.constexpr, GQA: tl.constexpr, GP: tl.constexpr,
                    BLOCK_T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (last) query tiles start first
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    t0 = pid_m * BLOCK_T
    if t0 >= q_len:
        return
    seq_len = tl.load(seqlen_ptr + b)
    ctx = seq_len - q_len  # cached tokens before this chunk
    BLOCK_M: tl.constexpr = BLOCK_T * GP
    r = tl.arange(0, BLOCK_M)
    ti = r // GP
    gi = r % GP
    row_ok = (t0 + ti < q_len) & (gi < GQA)
    tok = (q_start + t0 + ti).to(tl.int64)
    hq = h * GQA + gi
    d = tl.arange(0, BLOCK_D)
    dm = (d < D)[None, :]
    q = tl.load(q_ptr + tok[:, None] * sqt + hq[:, None] * sqh + d[None, :], mask=row_ok[:, None] & dm, other=0.0)
    q = q.to(DT)
    if ROTATED:  # natural -> rotated, word-ordered (exact +-1/8 operand, float32 accumulation)
        q2 = _dot(tl.reshape(q, (BLOCK_M * (BLOCK_D // 64), 64)), rot64_word_order(False, DT), DOT_F32)
        q = tl.reshape(q2, (BLOCK_M, BLOCK_D)).to(DT)
    qpos = ctx + t0 + ti
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * sbt
    n_full = (ctx + t0 + 1) // BLOCK_N  # KV tiles every row of the query tile sees completely
    kv_end = tl.minimum(seq_len, ctx + t0 + BLOCK_T)
    n_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    for i in range(0, n_full):
        acc, m_i, l_i = _attend_page(acc, m_i, l_i, q, kd, ks, vd, vs, bt_row, i, h, HKV, qpos, seq_len,
                                     qk_scale, False, FMT, D, BLOCK_D, PAGE, BLOCK_N, DT, DOT_F32)
    for i in range(n_full, n_tiles):
        acc, m_i, l_i = _attend_page(acc, m_i, l_i, q, kd, ks, vd, vs, bt_row, i, h, HKV, qpos, seq_len,
                                     qk_scale, True, FMT, D, BLOCK_D, PAGE, BLOCK_N, DT, DOT_F32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if ROTATED:  # word-ordered rotated -> natural: out @ M^T
        o2 = tl.reshape(out, (BLOCK_M * (BLOCK_D // 64), 64))
        if DOT_F32:
            o2 = _dot(o2, rot64_word_order(True, tl.float32), True)
        else:  # hi + lo split keeps ~16 mantissa bits through the 16-bit tensor-core dot
            hi = o2.to(DT)
            lo = (o2 - hi.to(tl.float32)).to(DT)
            mt = rot64_word_order(True, DT)
            o2 = tl.dot(hi, mt) + tl.dot(lo, mt)
        out = tl.reshape(o2, (BLOCK_M, BLOCK_D))
    tl.store(o_ptr + tok[:, None] * sot + hq[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dm)


# Tiles that had to shrink to fit shared memory, remembered so later calls launch at once.
_FITTED_TILES: dict[tuple, tuple[int, int]] = {}


def _default_tiles(code: int, d: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps). Chosen without a GPU from sm_90 compiles (ptxas registers and
    spills, SASS instructions per key in the KV loop), not yet confirmed by a timing sweep: 128 query
    rows (wgmma, and every K/V tile dequantized once per 128 rows) for every format; BLOCK_N the
    largest without spills in the loop."""
    if d <= 128:
        return 128, 64, 8
    return (128, 32, 8) if code == FMT_COPY else (128, 16, 8)


def _planes(p, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(p, torch.Tensor):
        return p, None
    if isinstance(p, dict):  # the pool's per-layer dict
        return p[name], p.get(f"{name}_scale")
    if isinstance(p, (tuple, list)) and len(p) in (1, 2):
        return p[0], (p[1] if len(p) == 2 else None)
    raise ValueError(f"paged_prefill: {name}_planes must be a tensor, (data, scale|None) or the pool's dict, "
                     f"got {type(p)}")


def paged_prefill_triton(q: torch.Tensor, k_planes, v_planes, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, fmt: KVFormat,
                         scale: float, *, block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                  out: torch.Tensor | None = None, exact_dots: bool | None = None) -> torch.Tensor:
    """Causal attention of the new tokens ``q`` [T, Hq, D] (flattened varlen batch, natural order)
    over their sequences' pages. ``k_planes``/``v_planes`` = (data [pages, Hkv, page, extent],
    scale fp16 [pages, Hkv, page, D/64] or None), or both = the pool's per-layer dict;
    ``query_start_loc`` [B+1] int32, ``seq_lens`` [B] int32 (tokens after this chunk, chunk
    included), ``block_tables`` [B, max_pages] int32 (-1 padded); ``max_query_len`` >= every
    chunk length. Tiling (defaults: ``_default_tiles``): ``block_m`` query rows (tokens x padded
    GQA group) per program, ``block_n`` keys per KV tile (divides the page), ``num_warps``.
    ``out``: optional contiguous [T, Hq, D] buffer in q's dtype. ``exact_dots``: float32 dot
    operands; default only for float32 q, or under the interpreter when they would be bf16 (its
    bf16 dot is broken); tests force False to run the fp16 GPU numerics on the interpreter.
    Returns out [T, Hq, D] in q's dtype."""
    code = kernel_code(fmt, "paged_prefill")
    kd, ks = _planes(k_planes, "k")
    vd, vs = _planes(v_planes, "v")
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"paged_prefill: q must be float [T, Hq, D], got {q.dtype}{list(q.shape)}")
    t, hq, d = q.shape
    if kd.dim() != 4 or vd.shape != kd.shape:
        raise ValueError(f"paged_prefill: k/v data planes {list(kd.shape)}/{list(vd.shape)} must match, 4-d")
    _, hkv, page, ext = kd.shape
    if hq % hkv:
        raise ValueError(f"paged_prefill: {hq} query heads are not a multiple of {hkv} KV heads")
    if ext != fmt.data_extent(d) or (code != FMT_COPY and kd.dtype != fmt.data_dtype()):
        raise ValueError(f"paged_prefill: kv_dtype={fmt.name} head_dim {d} wants extent {fmt.data_extent(d)}, "
                         f"planes are {kd.dtype} x {ext}")
    if fmt.has_scales and (ks is None or vs is None or ks.shape != (*kd.shape[:3], d // 64)
                           or ks.dtype != torch.float16 or vs.shape != ks.shape):
        raise ValueError(f"paged_prefill: kv_dtype={fmt.name} needs fp16 scale planes [pages, Hkv, page, {d // 64}]")
    if page < 16 or page & (page - 1):
        raise ValueError(f"paged_prefill: page size must be a power of 2 >= 16, got {page}")
    if fmt.rotated and (d < 64 or d & (d - 1)):
        raise ValueError(f"paged_prefill: kv_dtype={fmt.name} kernel needs a power-of-2 head_dim >= 64, got {d}")
    if code == FMT_COPY and kd.dtype not in _TL_DTYPE:
        raise ValueError(f"paged_prefill: kv_dtype={fmt.name} planes must be bf16/fp16/fp32, got {kd.dtype}")
    b = seq_lens.shape[0]
    if (query_start_loc.shape != (b + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != b
            or block_tables.stride(1) != 1):
        raise ValueError("paged_prefill: query_start_loc [B+1], seq_lens [B], block_tables [B, max_pages] disagree")
    for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"paged_prefill: {name} must be int32 on {q.device}, got {x.dtype} on {x.device}")
    for x in (kd, vd) + ((ks, vs) if fmt.has_scales else ()):
        if not x.is_contiguous() or x.device != q.device:
            raise ValueError("paged_prefill: KV planes must be contiguous and on q's device")
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()):
        raise ValueError(f"paged_prefill: out must be contiguous {q.dtype}{list(q.shape)}")
    final = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    interp = _interpreting()
    op_dt = tl.float16 if code != FMT_COPY else _TL_DTYPE.get(kd.dtype)
    dot_f32 = q.dtype == torch.float32 or op_dt == tl.float32 or (interp and op_dt == tl.bfloat16)
    if exact_dots is not None:
        if interp and op_dt == tl.bfloat16 and not exact_dots:
            raise ValueError("paged_prefill: the Triton interpreter cannot run bf16 dots")
        dot_f32 = bool(exact_dots)
    # Interpreter: float32 buffer, cast by torch (its own fp32->bf16 cast truncates).
    kout = torch.empty(q.shape, dtype=torch.float32, device=q.device) if interp and q.dtype != torch.float32 else final
    if t == 0 or b == 0 or max_query_len <= 0:
        return final
    if ks is None:
        ks, vs = kd, vd  # unused by the unscaled variants
    if code in (FMT_RK4, FMT_E8):
        kd, vd = kd.view(torch.int32), vd.view(torch.int32)
    gqa = hq // hkv
    gp = triton.next_power_of_2(gqa)
    dm, dn, dw = _default_tiles(code, d)
    block_m, block_n, num_warps = block_m or dm, min(block_n or dn, page), num_warps or dw
    if block_n < 16 or block_n & (block_n - 1) or block_m & (block_m - 1):
        raise ValueError(f"paged_prefill: block_m {block_m} / block_n {block_n} must be powers of 2, block_n >= 16")
    block_t = max(1, block_m // gp)
    block_d = triton.next_power_of_2(d)
    key = (code, d, kd.dtype, gp, dot_f32, block_t, block_n, num_warps)
    block_t, block_n = _FITTED_TILES.get(key, (block_t, block_n))
    while True:
        grid = (triton.cdiv(int(max_query_len), block_t), b, hkv)
        try:
            _prefill_kernel[grid](
                q, q.stride(0), q.stride(1), kd, ks, vd, vs, kout, kout.stride(0), kout.stride(1),
                query_start_loc, seq_lens, block_tables, block_tables.stride(0), hkv,
                float(scale) * math.log2(math.e), FMT=code, ROTATED=fmt.rotated, GQA=gqa, GP=gp,
                BLOCK_T=block_t, D=d, BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n,
                DT=tl.float32 if dot_f32 else op_dt, DOT_F32=dot_f32, num_warps=num_warps)
            _FITTED_TILES[key] = (block_t, block_n)
            break
        except OutOfResources:
            # Seen on the H200 (2026-11-30): fp32 planes at D=256 with the default tiles need
            # 246 KB of shared memory (limit 232 KB). Halve the key tile, then the query tile.
            if block_n > 16:
                block_n //= 2
            elif block_t > 1:
                block_t //= 2
            else:
                raise
    if kout is not final:
        final.copy_(kout)
    return final


def paged_prefill_ref(q: torch.Tensor, k_planes, v_planes, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, max_query_len: int, fmt: KVFormat, scale: float,
                      *, kv_round: torch.dtype | None = None) -> torch.Tensor:
    """Torch oracle for :func:`paged_prefill_triton`: decode each sequence's pages with the format's
    reference decoder and attend causally in float32 (host loop over sequences). ``kv_round``
    (e.g. fp16, the kernel's dot operand for scaled formats) rounds the decoded values, still in the
    stored (rotated) domain, like the kernel does, so a test can compare tightly."""
    kd, ks = _planes(k_planes, "k")
    vd, vs = _planes(v_planes, "v")
    t, hq, d = q.shape
    hkv, page = kd.shape[1], kd.shape[2]
    group = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(sl):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 == q0:
            continue
        pages = block_tables[b, : -(-seq_len // page)].long()

        def gather(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            y = x[pages]  # [P, Hkv, page, E]
            return y.permute(1, 0, 2, 3).reshape(hkv, -1, y.shape[-1])[:, :seq_len]

        k, v = (fmt.decode(gather(x), gather(xs), rotated=kv_round is not None, dtype=torch.float32)
                for x, xs in ((kd, ks), (vd, vs)))  # [Hkv, L, D]
        if kv_round is not None:
            k, v = (x.to(kv_round).float() for x in (k, v))
            if fmt.rotated:
                k, v = rotate(k), rotate(v)
        qb = q[q0:q1].float().permute(1, 0, 2)  # [Hq, n, D]
        s = torch.einsum("hnd,hld->hnl", qb, k.repeat_interleave(group, 0)) * scale
        qpos = torch.arange(seq_len - (q1 - q0), seq_len, device=q.device)
        s.masked_fill_(torch.arange(seq_len, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        out[q0:q1] = torch.einsum("hnl,hld->hnd", s.softmax(-1), v.repeat_interleave(group, 0)).permute(1, 0, 2)
    return out.to(q.dtype)
