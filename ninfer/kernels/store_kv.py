"""Store kernel: new K/V rows -> (rotate, scale, quantize, pack) -> scatter into KV pages.

One Triton program handles up to BLOCK_T tokens x one KV head x one 64-group of K or of V, so a
launch is ``(cdiv(T, BT), Hkv, 2 x groups)`` programs and its grid depends only on T (CUDA-graph
safe: no host sync, no data-dependent sizes). Slots of -1 are skipped. A decode step stores one
token per sequence: its whole cost is the latency of one program (load, butterfly, scale, E8
search, pack, store), so a small T gets a small tile (BT = next power of 2 >= T, >= 2) on one
warp, and K/V and groups run in parallel programs rather than one after another (H200, 90K-token
Qwen3-8B decode: 12.4 us per layer for rk4v4-e8 with all of a token's groups, K and V, in one
16-row program).

Bit-exactness with the torch reference (``ninfer/kvcache/formats/`` + ``e8.py``):
* rotation ``x @ R`` (R = S.H64.S, ``kvcache/hadamard.py``) is the 6-stage Walsh-Hadamard
  butterfly in float32 (``rotate_rows_fwht``; ``STORE_FWHT = False`` selects the older float32
  FMA ``tl.dot``): every intermediate is a signed partial sum of the same exact +-1/8 terms, so it
  equals torch's float32 matmul whenever that sum is exact in float32 (true for bf16/fp16 K/V
  whose 64-group spans <= ~10 binades); otherwise the two may differ in the last ulp of a
  rotated value, as ``hadamard.py`` states, and rarely in a code;
* the 4-bit formats split each token's 64 rotated values into 8 slices of 8 words (``tl.split``
  on a [token, word, j] view), so the E8 search (argmax / argmin as strict scans = the first
  one), the parity fix, the sequential sum and the nibble packing are elementwise per word;
* everything after the rotation is the reference's exact op sequence: float32 absmax, IEEE
  division by C (``div_rn``, not Triton's approximate ``/``), the fp16 scale (int8: nearest
  even, underflow -> 2^-24; 4-bit: rounded up), ``z = x * RN(1/s)`` (rk4v4-e8: the exact product
  rounded to the 2^-8 grid, in float64), ``rint`` via the 1.5*2^23
  trick (round half to even), the E8 search with the same keys, tie rules and the sequential
  j = 0..7 sum.
* Where the reference raises (NaN/Inf, a scale that overflows fp16) a kernel cannot (no host
  sync): the scale saturates at 65504 and codes clamp to the box.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels._common import FMT_E8, FMT_INT8, FMT_PLAIN, FMT_RK4, kernel_code
from ninfer.kernels.hadamard import rot64, rotate_rows_fwht
from ninfer.kvcache.formats import GROUP, KVFormat

# Format switch (constexpr): one compiled variant per format; FMT_COPY = unquantized planes.
FMT_COPY = FMT_PLAIN
BLOCK_T = 16  # tokens per program of the 4-bit formats (tl.dot needs M >= 16)
BLOCK_T_WIDE = 32  # unquantized copy and int8 (H200, 16384 tokens: int8 56.6 -> 46.7 us vs 16 rows)
STORE_FWHT = True  # rotation by butterfly (False: fp32 FMA tl.dot); module switch for the bench


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
def _e8_words(zs):
    """The E8 search per word, elementwise on the 8 slices zs[j] ([BT, 8 (w)] float32) -> packed
    words with the coset bit: ``e8.coset_candidates``' ops, keys, tie rules and sequential sum."""
    s = tl.zeros(zs[0].shape, tl.float32)
    k0b = tl.zeros(zs[0].shape, tl.float32)
    vb = tl.zeros(zs[0].shape, tl.float32)
    j0 = tl.zeros(zs[0].shape, tl.int32)
    j1 = tl.zeros(zs[0].shape, tl.int32)
    w0 = tl.zeros(zs[0].shape, tl.int32)
    m = tl.zeros(zs[0].shape, tl.int32)
    for j in tl.static_range(8):
        z = zs[j]
        f = tl.minimum(tl.maximum(_rint(z), -8.0), 7.0)
        r = z - f
        a = tl.minimum(tl.abs(r), z + 8.0)
        k0 = tl.minimum(a, 7.0 - z)
        v = tl.maximum(a, -7.0 - z)
        if j == 0:
            s = a
            k0b = k0
            vb = v
        else:
            s = s + a  # sequential order, as the reference sums
            u0 = k0 > k0b  # strict: the first maximum (lowest j) wins, as argmax
            k0b = tl.where(u0, k0, k0b)
            j0 = tl.where(u0, j, j0)
            u1 = v < vb  # the first minimum, as argmin
            vb = tl.where(u1, v, vb)
            j1 = tl.where(u1, j, j1)
        w0 = w0 | ((f.to(tl.int32) + 8) << (4 * j))
        m = m | (((r < 0.0) & (a > 0.0)).to(tl.int32) << (4 * j))
    w1 = w0 - m  # the half coset's values f - m: never below -8
    odd0 = _parity8(w0 & 0x11111111) != 0
    odd1 = _parity8(w1 & 0x11111111) != 0
    p0 = tl.where(odd0, 1.0 - 2.0 * k0b, 0.0)
    p1 = tl.where(odd1, 1.0 - 2.0 * (0.5 - vb), 0.0)
    half = ((2.0 - s) + p1) < p0  # ties keep the integer coset
    w = tl.where(half, w1, w0)
    sh = 4 * tl.where(half, j1, j0)
    nib = (w >> sh) & 15
    up = ((m >> sh) & 1) == half.to(tl.int32)  # integer coset: up unless r < 0; half: up iff m
    up = tl.where(up, nib < 15, nib == 0)  # at the box edge: inward
    w = w + tl.where(tl.where(half, odd1, odd0), tl.where(up, 1, -1) << sh, 0)
    return (w & ~(1 << 28)) | (half.to(tl.int32) << 28)


@triton.jit
def _parity8(x):
    """Parity of the bits of x (int32) at 0, 4, ..., 28."""
    x = x ^ (x >> 16)
    x = x ^ (x >> 8)
    x = x ^ (x >> 4)
    return x & 1


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
    s16 = raw.to(tl.float16, fp_downcast_rounding="rtne")
    if FMT == 1:
        s16 = tl.where((s16 == 0.0) & (amax > 0.0), 5.960464477539063e-08, s16)  # 2^-24
    else:  # the 4-bit rule rounds up: one fp16 step where rounding went down
        up = (s16.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
        s16 = tl.where(s16.to(tl.float32) < raw, up, s16)
    s = s16.to(tl.float32)
    tl.store(scale_ptr + rows * G + g, s16, mask=valid)
    y = tl.where(s > 0.0, tl.math.div_rn(tl.full([BT], 1.0, tl.float32), tl.where(s > 0.0, s, 1.0)), 0.0)
    if FMT == 3:  # on the 2^-8 grid (e8.GRID): the exact product (float64 holds it) rounded once at 1.5 * 2^44
        z = (((r.to(tl.float64) * y.to(tl.float64)[:, None]) + 26388279066624.0) - 26388279066624.0).to(tl.float32)
    else:
        z = r * y[:, None]  # code units: x * RN(1/s), as formats.code_units
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
            words = _e8_words(zs)
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


def checked_store_args(k: torch.Tensor, v: torch.Tensor, planes: dict, slot_mapping: torch.Tensor,
                       fmt: KVFormat) -> tuple:
    """The checks every store implementation shares -> (code, kd, ks, vd, vs, page); the packed
    formats' data planes come back as int32 words (8 nibbles per little-endian word)."""
    code = kernel_code(fmt, "store_kv")
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
    return code, kd, ks, vd, vs, page


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, planes: dict, slot_mapping: torch.Tensor, fmt: KVFormat,
                    *, block_t: int | None = None, num_warps: int | None = None) -> None:
    """Encode k/v [T, Hkv, D] with format ``fmt`` and write them to ``planes`` (the pool's
    per-layer dict) at ``slot_mapping`` [T] (page * page_size + offset; -1 = skip). In place.
    block_t / num_warps: tuning knobs (tokens per program, a power of 2 >= 2). The CUDA C++ store
    (store_kv_cuda.py) writes the same bytes for rk4v4 / rk4v4-e8."""
    code, kd, ks, vd, vs, page = checked_store_args(k, v, planes, slot_mapping, fmt)
    t, hkv, d = k.shape
    bt = block_t or (BLOCK_T_WIDE if code in (FMT_COPY, FMT_INT8) else BLOCK_T)
    if bt < 2 or bt & (bt - 1):
        raise ValueError(f"store_kv: block_t must be a power of 2 >= 2, got {bt}")
    if num_warps is not None and (num_warps < 1 or num_warps > 32 or num_warps & (num_warps - 1)):
        raise ValueError(f"store_kv: num_warps must be a power of 2 in 1..32, got {num_warps}")
    if t == 0:
        return
    if code == FMT_COPY and k.dtype != kd.dtype:
        # torch's round-to-nearest cast (rare: model dtype differs from bf16 storage); the
        # interpreter's own fp32->bf16 conversion does not round to nearest even.
        k, v = k.to(kd.dtype), v.to(kd.dtype)
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if STORE_FWHT or code in (FMT_COPY, FMT_INT8):  # only the tl.dot rotation needs 16 rows
        bt = min(bt, max(2, triton.next_power_of_2(t)))
    grid = (triton.cdiv(t, bt), hkv, 2 * (1 if code == FMT_COPY else d // GROUP))
    _store_kv_kernel[grid](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kd, ks, vd, vs, slot_mapping,
        t, hkv, float(fmt.scale_divisor or 1.0),
        FMT=code, D=d, BLOCK_D=triton.next_power_of_2(d), PAGE=page, BT=bt, FWHT=STORE_FWHT,
        num_warps=num_warps or (1 if bt <= 4 else 4),
        enable_fp_fusion=False)  # no FMA contraction: every rounding as in the reference
