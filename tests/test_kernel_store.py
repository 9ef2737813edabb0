"""Store kernel (ninfer/kernels/store_kv.py) vs the reference encoder, bit for bit, on CPU.

Interpreter: every kernel check runs in one child process with ``TRITON_INTERPRET=1``
(tests/triton_interp.py says why and how).

What a case checks: planes start poisoned with random bytes; ``store_kv_triton`` and the reference
(``fmt.encode`` + scatter) write the same slots; every plane must be byte-identical afterwards
(so -1 slots and all other slots stay untouched). Inputs: fresh random values whose rotation is
exact in float32 in any summation order (k/32 times a power-of-two scale per group), so
bit-exactness is well defined (for arbitrary inputs the rotation sums may differ in the last ulp,
see store_kv.py); adversarial groups (all zero, huge, scales that
underflow fp16 to 2^-24 or land on fp16 subnormals); exact ties in code units (multiples of 1/4
with the scale forced to 1: rounding halves, E8 coset ties, equal parity-fix keys, box edges);
odd token counts, slots at page boundaries, K/V as strided views of a fused tensor.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.triton_interp import FORMATS, child_main, exact_values, case_result, module_results  # noqa: E402,F401

# (name, fmt, kind, T, Hkv, D, dtype, seed)
CASES = []
for _f in FORMATS:
    for _s in (0, 1):
        CASES.append((f"{_f}-random-s{_s}", _f, "random", 37, 2, 128, "bfloat16", _s))
    CASES.append((f"{_f}-adversarial", _f, "adversarial", 21, 2, 128, "bfloat16", 7))
for _f in ("int8", "rk4v4", "rk4v4-e8"):
    CASES.append((f"{_f}-ties", _f, "ties", 19, 2, 128, "float32", 3))
CASES.append(("rk4v4-e8-d256-fp16-odd", "rk4v4-e8", "random", 5, 1, 256, "float16", 11))
CASES.append(("rk4v4-e8-d64-ties-s2", "rk4v4-e8", "ties", 33, 1, 64, "float32", 12))
CASES.append(("auto-fp32-d80", "auto", "random", 9, 3, 80, "float32", 13))
# decode-sized steps: the small-tile variants (BT = 2 / 4, one warp)
for _f in FORMATS:
    for _t in (1, 3):
        CASES.append((f"{_f}-decode-t{_t}", _f, "random", _t, 3, 128, "bfloat16", 20 + _t))
CASES.append(("rk4v4-e8-decode-d256-t2", "rk4v4-e8", "random", 2, 2, 256, "bfloat16", 25))
# several programs per head, every 64-group of a D=256 row in its own program
for _f in ("int8", "rk4v4", "rk4v4-e8"):
    CASES.append((f"{_f}-d256-t70", _f, "random", 70, 2, 256, "bfloat16", 14))
# the benchmark's tiling knob (tokens per program): other tiles, same bytes as the reference
CASES.append(("rk4v4-e8-bt32", "rk4v4-e8", "random", 70, 2, 128, "bfloat16", 15, 32))
CASES.append(("int8-bt8", "int8", "random", 37, 2, 128, "bfloat16", 16, 8))


def _ties(gen, fmt, shape):
    """Values whose code units are exactly multiples of 1/4 (1/2 for int8) with scale 1."""
    import torch

    from ninfer.kvcache.hadamard import rotate

    c = float(fmt.scale_divisor)
    step = 0.5 if not fmt.rotated else 0.25
    n = int(c / step)
    z = torch.randint(-n, n, shape, generator=gen).to(torch.float64) * step
    z[..., 0::64] = c * torch.where(torch.rand(z[..., 0::64].shape, generator=gen) < 0.5, -1.0, 1.0)  # absmax = C
    z[..., 5::64] = 0.25  # runs of equal values: equal E8 keys, coset ties
    z[..., 13::64] = 0.25
    x = rotate(z) if fmt.rotated else z  # R is self-inverse: the kernel's rotation gives z back exactly
    return x.to(torch.float32)


def _run_case(name, fmt_name, kind, t, hkv, d, dtype_name, seed, block_t=None, device="cpu", backend="triton"):
    import torch

    from ninfer.kernels.store_kv import store_kv_triton
    from ninfer.kernels.store_kv_cuda import store_kv_cuda
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    page, num_pages = 64, max(4, -(-2 * t // 64))
    shape = (t, hkv, d)
    if kind == "ties":
        k, v = _ties(gen, fmt, shape), _ties(gen, fmt, shape)
    else:
        k, v = exact_values(gen, shape, dtype), exact_values(gen, shape, dtype)
    if kind == "adversarial":
        for x in (k, v):
            x[1, 0] = 0  # all-zero groups
            x[2, :, :64] = exact_values(gen, (hkv, 64), dtype, 12, 12)  # huge (scale still fits fp16)
            x[3, :, :64] = exact_values(gen, (hkv, 64), dtype, -40, -40)  # scale underflows -> 2^-24
            x[4] = exact_values(gen, (hkv, d), dtype, -20, -18)  # fp16 subnormal scales
            x[5, 1, 64:] = 0
    # K/V as strided views of one fused [T, 3, Hkv, D] tensor, like a fused qkv projection.
    fused = torch.zeros(t, 3, hkv, d, dtype=k.dtype)
    fused[:, 1], fused[:, 2] = k, v
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_pages * page, generator=gen)[:t]
    for i, s in enumerate((63, 64, 127, 128)):  # page boundaries
        if i + 6 < t:
            slots[slots == s] = slots[i + 6].item()
            slots[i + 6] = s
    skip = torch.rand(t, generator=gen) < 0.15
    skip[0] = False  # at least one stored token, also at T = 1
    slots = torch.where(skip, torch.full_like(slots, -1), slots)
    model_dtype = dtype if fmt.storage is None else torch.bfloat16
    planes, ref = {}, {}
    for pl in fmt.planes(d, model_dtype):
        raw = torch.randint(0, 256, (num_pages, hkv, page, pl.extent * torch.empty((), dtype=pl.dtype).element_size()),
                            generator=gen, dtype=torch.uint8)
        planes[pl.name] = raw.view(pl.dtype).clone()
        ref[pl.name] = raw.view(pl.dtype).clone()
    dev = {n: p.to(device) for n, p in planes.items()}
    fused = fused.to(device)
    if backend == "cuda":
        store_kv_cuda(fused[:, 1], fused[:, 2], dev, slots.to(device), fmt)
    else:
        store_kv_triton(fused[:, 1], fused[:, 2], dev, slots.to(device), fmt, block_t=block_t)
    planes = {n: p.cpu() for n, p in dev.items()}
    keep = slots >= 0
    pg, off = slots[keep] // page, slots[keep] % page
    for which, x in (("k", k), ("v", v)):
        data, sc = fmt.encode(x[keep])
        ref[which][pg, :, off] = data.to(ref[which].dtype)
        if sc is not None:
            ref[f"{which}_scale"][pg, :, off] = sc
    bad = {n: int((planes[n].view(torch.uint8) != ref[n].view(torch.uint8)).sum()) for n in planes}
    return {"name": name, "mismatched_bytes": bad, "stored": int(keep.sum())}


def _child() -> int:
    return child_main(CASES, _run_case)


results = module_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_store_kv_bit_exact(results, case):
    r = case_result(results, case[0])
    assert r["stored"] > 0
    assert all(v == 0 for v in r["mismatched_bytes"].values()), f"planes differ from the reference: {r}"


def test_store_kv_rejects_bad_inputs():
    import torch

    from ninfer.kernels.store_kv import store_kv_triton as store_kv
    from ninfer.kernels.store_kv_cuda import store_kv_cuda
    from ninfer.kvcache.formats import get_format

    e8, rk4, int8 = get_format("rk4v4-e8"), get_format("rk4v4"), get_format("int8")
    k = torch.zeros(3, 2, 128, dtype=torch.bfloat16)
    planes = {"k": torch.zeros(2, 2, 64, 64, dtype=torch.uint8), "v": torch.zeros(2, 2, 64, 64, dtype=torch.uint8),
              "k_scale": torch.zeros(2, 2, 64, 2, dtype=torch.float16),
              "v_scale": torch.zeros(2, 2, 64, 2, dtype=torch.float16)}
    slots = torch.arange(3)
    with pytest.raises(ValueError):
        store_kv(k, k[:, :1], planes, slots, e8)  # k/v shapes
    with pytest.raises(ValueError):
        store_kv(k, k, planes, slots[:2], e8)  # slot count
    with pytest.raises(ValueError):
        store_kv(k, k, planes, slots.float(), e8)  # slot dtype
    with pytest.raises(ValueError):
        store_kv(k, k, {**planes, "k": planes["k"].view(torch.int8)}, slots, e8)  # plane dtype
    with pytest.raises(ValueError):
        store_kv(k, k, planes, slots, int8)  # int8 extent is D, not D/2
    with pytest.raises(ValueError):
        store_kv(k, k, {"k": planes["k"], "v": planes["v"]}, slots, rk4)  # scales missing
    with pytest.raises(TypeError, match="format object"):
        store_kv(k, k, planes, slots, "rk4v4-e8")  # a name, not the format
    with pytest.raises(ValueError):
        store_kv(k, k, planes, slots, e8, block_t=24)  # not a power of 2
    with pytest.raises(ValueError):
        store_kv(k, k, planes, slots, e8, num_warps=3)
    with pytest.raises(ValueError, match="store_kv_cuda: not on CUDA"):
        store_kv_cuda(k, k, planes, slots, e8)
    with pytest.raises(ValueError, match="store_kv_cuda: format int8 has no CUDA store"):
        store_kv_cuda(k, k, {n: torch.zeros(2, 2, 64, 128 if n in "kv" else 2, dtype=torch.int8 if n in "kv"
                                            else torch.float16) for n in planes}, slots, int8)
    assert all(int(p.view(torch.uint8).count_nonzero()) == 0 for p in planes.values())  # nothing written


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
