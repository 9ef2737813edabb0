"""Store kernel: new K/V rows -> (rotate, scale, quantize, pack) -> scatter into KV pages.

One Triton program handles up to BLOCK_T tokens x one KV head x one 64-group of K or of V, so a
launch is ``(cdiv(T, BT), Hkv, 2 x groups)`` programs and its grid depends only on T (CUDA-graph
safe: no host sync, no data-dependent sizes). Slots of -1 are skipped. A decode step stores one
token per sequence: its whole cost is the latency of one program (load, butterfly, scale, E8
search, pack, store), so a small T gets a small tile (BT = next power of 2 >= T, >= 2) on one
warp, and K/V and groups run in parallel programs rather than one after another (H200, 90K-token
Qwen3-8B decode: 12.4 us per layer for rk4v4-e8 with all of a token's groups, K and V, in one
16-row program).

Bit-exactness with the torch reference (``ninfer/kvcache/formats.py`` + ``e8.py``):
* rotation ``x @ R`` (R = S.H64.S, ``kvcache/hadamard.py``) is the 6-stage Walsh-Hadamard
  butterfly in float32 (``rotate_rows_fwht``; ``STORE_FWHT = False`` selects the older float32
  FMA ``tl.dot``): every intermediate is a signed partial sum of the same exact +-1/8 terms, so it
  equals torch's float32 matmul whenever that sum is exact in float32 (true for bf16/fp16 K/V
  whose 64-group spans <= ~10 binades); otherwise the two may differ in the last ulp of a
  rotated value, as ``hadamard.py`` states, and rarely in a code;
* the 4-bit formats split each token's 64 rotated values into 8 slices of 8 words (``tl.split``
  on a [token, word, j] view), so the E8 search (argmax as a strict-> scan = first maximum),
  the parity fix, the sequential distance sum and the nibble packing are elementwise per word;
* everything after the rotation is the reference's exact op sequence: float32 absmax, IEEE
  division by C (``div_rn``, not Triton's approximate ``/``), round-to-nearest-even fp16 scale
  (underflow -> 2^-24), IEEE ``z = x / s``, ``rint`` via the 1.5*2^23 trick (round half to even),
  the E8 search with the same keys, tie rules and the sequential j = 0..7 distance sum.
* Where the reference raises (NaN/Inf, a scale that overflows fp16) a kernel cannot (no host
  sync): the scale saturates at 65504 and codes clamp to the box.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ninfer.kernels._common import FMT_E8, FMT_INT8, FMT_PLAIN, FMT_RK4, fmt_code
from ninfer.kernels.hadamard import rot64, rotate_rows_fwht
from ninfer.kvcache.formats import GROUP, get_format

# Format switch (constexpr): one compiled variant per format; FMT_COPY = unquantized planes.
FMT_COPY = FMT_PLAIN
BLOCK_T = 16  # tokens per program of the 4-bit formats (tl.dot needs M >= 16)
BLOCK_T_WIDE = 32  # unquantized copy and int8 (H200, 16384 tokens: int8 56.6 -> 46.7 us vs 16 rows)
STORE_FWHT = True  # rotation by butterfly (False: fp32 FMA tl.dot); module switch for the bench
log = logging.getLogger(__name__)


@triton.jit
def _rint(x):
    # Round half to even for |x| < 2^22 (all code units here): the add rounds at integer ulp.
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _split8(x):
    """[..., 8 (w), 8 (j)] -> the 8 [..., 8 (w)] slices j = 0..7 (each thread owns its words' j's)."""
    x = tl.reshape(x, (x.shape[0], x.shape[1], 2, 2, 2))  # j = 4 j2 + 2 j1 + j0, j0 last
    a, b = tl.split(x)  # j0 = 0 / 1
    a0, a1 = tl.split(a)  # j1
    b0, b1 = tl.split(b)
    y0, y4 = tl.split(a0)
    y2, y6 = tl.split(a1)
    y1, y5 = tl.split(b0)
    y3, y7 = tl.split(b1)
    return (y0, y1, y2, y3, y4, y5, y6, y7)


@triton.jit
def _nearest_even_in_box(ys, off):
    """E8's D8 coset search per word, elementwise on 8 slices ys[j] - off ([BT, 8 (w)] float32):
    -> (codes n_j int32 with an even sum, squared distance). Same keys, tie rules and the
    sequential j = 0..7 distance sum as the reference (``e8.py``)."""
    par = tl.zeros(ys[0].shape, tl.int32)
    best = tl.full(ys[0].shape, -1.0, tl.float32)
    bj = tl.zeros(ys[0].shape, tl.int32)
    fs = ()
    ts = ()
    for j in tl.static_range(8):
        y = ys[j] - off
        f = tl.minimum(tl.maximum(_rint(y), -8.0), 7.0)
        r = y - f
        t = tl.where(r >= 0, 1.0, -1.0)
        t = tl.where((f + t > 7.0) | (f + t < -8.0), -t, t)  # box edge: inward neighbour
        key = r * t
        if j == 0:
            best = key
        else:
            upd = key > best  # strict: the first maximum (lowest j) wins, as argmax(tie_break_left)
            best = tl.where(upd, key, best)
            bj = tl.where(upd, j, bj)
        fi = f.to(tl.int32)
        par = par ^ (fi & 1)
        fs = fs + (fi,)
        ts = ts + (t.to(tl.int32),)
    odd = par != 0
    ns = ()
    d = tl.zeros(ys[0].shape, tl.float32)
    for j in tl.static_range(8):
        n = fs[j] + tl.where(odd & (bj == j), ts[j], 0)
        e = (ys[j] - off) - n.to(tl.float32)
        if j == 0:
            d = e * e
        else:
            d = d + e * e  # sequential order, as the reference sums
        ns = ns + (n,)
    return ns, d


@triton.jit
def _store_group(x_ptr, sxt, sxh, data_ptr, scale_ptr, rows, tok, valid, h, g, C,
                 FMT: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, FWHT: tl.constexpr):
    """One 64-group of BT tokens: rotate, scale, quantize, pack, store."""
    G: tl.constexpr = D // 64
    d = tl.arange(0, 64)
    m = valid[:, None]
    x = tl.load(x_ptr + tok[:, None] * sxt + h * sxh + g * 64 + d[None, :], mask=m, other=0.0)
    r = x.to(tl.float32)
    if FMT != 1:
        if FWHT:  # Walsh-Hadamard butterfly: 384 adds per row (see hadamard.py)
            r = rotate_rows_fwht(r)
        else:  # float32 operands, IEEE accumulation: exact +-1/8 products, no TF32.
            r = tl.dot(r, rot64(tl.float32), input_precision="ieee")
    amax = tl.max(tl.abs(r), axis=1)
    raw = tl.minimum(tl.math.div_rn(amax, tl.full([BT], C, tl.float32)), 65504.0)
    s = raw.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    s = tl.where((s == 0.0) & (amax > 0.0), 5.960464477539063e-08, s)  # 2^-24
    tl.store(scale_ptr + rows * G + g, s.to(tl.float16), mask=valid)
    pos = s > 0.0
    z = tl.where(pos[:, None], tl.math.div_rn(r, tl.where(pos, s, 1.0)[:, None]), 0.0)
    if FMT == 1:
        q = tl.minimum(tl.maximum(_rint(z), -127.0), 127.0)
        tl.store(data_ptr + rows[:, None] * D + g * 64 + d[None, :], q.to(tl.int8), mask=m)
    else:
        # coordinate 8j + w -> [token, w, j]; every word's 8 coordinates become 8 [BT, 8] slices,
        # so the lattice search and the packing are elementwise (no cross-lane reductions).
        zs = _split8(tl.permute(tl.reshape(z, (BT, 8, 8)), (0, 2, 1)))
        if FMT == 2:
            words = tl.zeros([BT, 8], tl.int32)
            for j in tl.static_range(8):
                u = tl.minimum(tl.maximum(_rint(zs[j]), -8.0), 7.0).to(tl.int32) + 8
                words = words | (u << (4 * j))
        else:
            n0, d0 = _nearest_even_in_box(zs, 0.0)
            n1, d1 = _nearest_even_in_box(zs, 0.5)
            half = d1 < d0  # ties keep the integer coset
            words = tl.zeros([BT, 8], tl.int32)
            for j in tl.static_range(8):
                u = tl.where(half, n1[j], n0[j]) + 8
                if j == 7:
                    u = (u & 0xE) | half.to(tl.int32)  # coset bit in nibble 7's low bit
                words = words | (u << (4 * j))
        w = tl.arange(0, 8)
        tl.store(data_ptr + rows[:, None] * (D // 8) + g * 8 + w[None, :], words, mask=m)


@triton.jit
def _store_one(x_ptr, sxt, sxh, data_ptr, scale_ptr, rows, tok, valid, h, g, C,
               FMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr,
               FWHT: tl.constexpr):
    if FMT == 0:
        # Unquantized: copy the whole row (any head_dim); the wrapper already cast to the plane dtype.
        d = tl.arange(0, BLOCK_D)
        if D == BLOCK_D:
            m = valid[:, None]
        else:
            m = valid[:, None] & (d[None, :] < D)
        x = tl.load(x_ptr + tok[:, None] * sxt + h * sxh + d[None, :], mask=m, other=0.0)
        tl.store(data_ptr + rows[:, None] * D + d[None, :], x, mask=m)
    else:
        _store_group(x_ptr, sxt, sxh, data_ptr, scale_ptr, rows, tok, valid, h, g, C, FMT, D, BT, FWHT)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, skt, skh, svt, svh, kd_ptr, ks_ptr, vd_ptr, vs_ptr, slot_ptr,
                     T, HKV, C,
                     FMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                     BT: tl.constexpr, FWHT: tl.constexpr = True):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    NG: tl.constexpr = 1 if FMT == 0 else D // 64  # programs per row of K (and of V)
    which = tl.program_id(2) // NG  # 0 = K, 1 = V
    g = tl.program_id(2) % NG
    tok = pid_t * BT + tl.arange(0, BT)
    inb = tok < T
    slot = tl.load(slot_ptr + tok, mask=inb, other=-1).to(tl.int64)
    valid = inb & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    # Row index of (page, head, offset) in a [pages, Hkv, PAGE, extent] plane.
    rows = ((slot // PAGE) * HKV + h) * PAGE + slot % PAGE
    tok = tok.to(tl.int64)
    if which == 0:
        _store_one(k_ptr, skt, skh, kd_ptr, ks_ptr, rows, tok, valid, h, g, C, FMT, D, BLOCK_D, BT, FWHT)
    else:
        _store_one(v_ptr, svt, svh, vd_ptr, vs_ptr, rows, tok, valid, h, g, C, FMT, D, BLOCK_D, BT, FWHT)


def _check_plane(planes: dict, name: str, dtype: torch.dtype, hkv: int, extent: int, device) -> torch.Tensor:
    if name not in planes:
        raise ValueError(f"store_kv: plane {name!r} missing (have {sorted(planes)})")
    p = planes[name]
    if p.dim() != 4 or p.shape[1] != hkv or p.shape[3] != extent or p.dtype != dtype:
        raise ValueError(f"store_kv: plane {name} is {p.dtype}{list(p.shape)}, expected "
                         f"{dtype}[pages, {hkv}, page, {extent}]")
    if not p.is_contiguous() or p.device != device:
        raise ValueError(f"store_kv: plane {name} must be contiguous on {device}")
    return p


def store_kv(k: torch.Tensor, v: torch.Tensor, planes: dict, slot_mapping: torch.Tensor, fmt_name: str,
             *, block_t: int | None = None, num_warps: int | None = None, backend: str = "auto") -> None:
    """Encode k/v [T, Hkv, D] with format ``fmt_name`` and write them to ``planes`` (the pool's
    per-layer dict) at ``slot_mapping`` [T] (page * page_size + offset; -1 = skip). In place.
    block_t / num_warps: tuning knobs of the Triton kernel (tokens per program, a power of 2 >= 2).
    backend: "auto" (the CUDA C++ store for rk4v4 / rk4v4-e8 where it runs, else Triton), "triton"
    or "cuda" (an error where it cannot run); both write the same bytes."""
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"store_kv: backend must be auto, triton or cuda, got {backend!r}")
    fmt = get_format(fmt_name)
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"store_kv: k {list(k.shape)} and v {list(v.shape)} must both be [T, Hkv, D]")
    if not (k.is_floating_point() and v.dtype == k.dtype):
        raise ValueError(f"store_kv: k/v must share a float dtype, got {k.dtype}/{v.dtype}")
    t, hkv, d = k.shape
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kv: slot_mapping must be int32/int64 [{t}], "
                         f"got {slot_mapping.dtype}{list(slot_mapping.shape)}")
    if k.device != slot_mapping.device or v.device != k.device:
        raise ValueError("store_kv: k, v and slot_mapping must be on one device")
    code = fmt_code(fmt)
    if code != FMT_COPY and d % GROUP:
        raise ValueError(f"store_kv: kv_dtype={fmt.name} needs head_dim % 64 == 0, got {d}")
    kp = planes.get("k")
    if kp is None:
        raise ValueError(f"store_kv: plane 'k' missing (have {sorted(planes)})")
    data_dt = fmt.data_dtype(kp.dtype)  # auto: the pool's model dtype
    ext = fmt.data_extent(d)
    kd = _check_plane(planes, "k", data_dt, hkv, ext, k.device)
    vd = _check_plane(planes, "v", data_dt, hkv, ext, k.device)
    page = kd.shape[2]
    if vd.shape != kd.shape or page & (page - 1):
        raise ValueError(f"store_kv: k/v planes {list(kd.shape)}/{list(vd.shape)} differ "
                         "or the page size is not a power of 2")
    if code == FMT_COPY:
        ks = vs = kd
    else:
        ks = _check_plane(planes, "k_scale", torch.float16, hkv, d // GROUP, k.device)
        vs = _check_plane(planes, "v_scale", torch.float16, hkv, d // GROUP, k.device)
    if code in (FMT_RK4, FMT_E8):
        kd, vd = kd.view(torch.int32), vd.view(torch.int32)  # 8 nibbles per little-endian word
    if t == 0:
        return
    if backend != "triton" and block_t is None and num_warps is None and _try_cuda(
            k, v, kd, ks, vd, vs, slot_mapping, code, fmt, page, backend):
        return
    if code == FMT_COPY and k.dtype != kd.dtype:
        # torch's round-to-nearest cast (rare: model dtype differs from bf16 storage); the
        # interpreter's own fp32->bf16 conversion does not round to nearest even.
        k, v = k.to(kd.dtype), v.to(kd.dtype)
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    bt = block_t or (BLOCK_T_WIDE if code in (FMT_COPY, FMT_INT8) else BLOCK_T)
    if bt < 2 or bt & (bt - 1):
        raise ValueError(f"store_kv: block_t must be a power of 2 >= 2, got {bt}")
    if num_warps is not None and (num_warps < 1 or num_warps > 32 or num_warps & (num_warps - 1)):
        raise ValueError(f"store_kv: num_warps must be a power of 2 in 1..32, got {num_warps}")
    if STORE_FWHT or code in (FMT_COPY, FMT_INT8):  # only the tl.dot rotation needs 16 rows
        bt = min(bt, max(2, triton.next_power_of_2(t)))
    grid = (triton.cdiv(t, bt), hkv, 2 * (1 if code == FMT_COPY else d // GROUP))
    _store_kv_kernel[grid](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kd, ks, vd, vs, slot_mapping,
        t, hkv, float(fmt.scale_divisor or 1.0),
        FMT=code, D=d, BLOCK_D=triton.next_power_of_2(d), PAGE=page, BT=bt, FWHT=STORE_FWHT,
        num_warps=num_warps or (1 if bt <= 4 else 4),
        enable_fp_fusion=False)  # no FMA contraction: every rounding as in the reference


def _try_cuda(k, v, kd, ks, vd, vs, slot_mapping, code, fmt, page, backend) -> bool:
    """Run the CUDA C++ store if it can take this call; False sends the call to Triton."""
    from ninfer.kernels import store_kv_cuda as sc
    why = sc.cuda_store_supported(k, fmt.name)
    if why is not None:
        if backend == "cuda":
            raise ValueError(f"store_kv: CUDA store unavailable: {why}")
        return False
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    try:
        sc.store_kv_cuda(k, v, kd, ks, vd, vs, slot_mapping, code, float(fmt.scale_divisor), page)
    except Exception as e:  # a broken nvcc or driver must not stop the engine: Triton writes the same bytes
        if backend == "cuda":
            raise
        sc._STORE.error = f"{type(e).__name__}: {e}"
        log.warning("store_kv: CUDA store failed (%s); the Triton store takes over", sc._STORE.error)
        return False
    return True
