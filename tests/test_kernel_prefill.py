"""Chunked-prefill kernel (ninfer/kernels/prefill.py) vs paged_prefill_ref, on CPU.

Interpreter: as tests/triton_interp.py describes, every kernel check runs
in one child process started with ``TRITON_INTERPRET=1`` (``python tests/test_kernel_prefill.py
--child``), so the result does not depend on what this pytest process imported before.

Per case (fresh random inputs from its seed, every format): the pool's pages are filled with
encoded random K/V (pages nobody reads too), block tables are shuffled and padded with -1,
the slots past each sequence's end are poisoned (NaN in float planes, NaN/Inf scales, random
bytes), the output buffer starts as NaN. Then every element must be written and finite, and
``|out - ref| <= 2^-8 |ref| + 1e-5`` elementwise, ``ref`` = paged_prefill_ref with the decoded
K/V rounded to fp16 exactly as the kernel's scaled-format tiles are. Under the interpreter the
kernel's dots run in float32 (see prefill.py), so the only error left is the final rounding of
the output to bf16 (<= 2^-9 relative); a wrong nibble, coset bit, page, mask or rotation shows
up far above that. Also ``||out - ref0|| / ||ref0|| <= 5e-3`` against the unrounded reference.
Scaled formats run a second time with the GPU's numerics (fp16 Q, tiles and P; hi/lo-split
output rotation; ``exact_dots`` left at its default): same bounds but 2e-3 * max|ref| absolute.
Shapes: GQA 1, 4, 6, 8; head_dim 64, 128, 256; chunks after cached prefixes that cross page
boundaries; varlen batches with a 1-token chunk; several query tiles per sequence.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.triton_interp import FORMATS, child_main, case_result, module_results  # noqa: E402

# (name, fmt, hq, hkv, d, [(cached, new) per sequence], seed[, paged_prefill tiling kwargs])
CASES = []
for _f in FORMATS:
    CASES.append((f"{_f}-gqa6-d128-prefix", _f, 6, 1, 128, [(70, 20)], 1))
    CASES.append((f"{_f}-gqa1-d256-varlen", _f, 2, 2, 256, [(0, 9), (64, 3), (5, 30)], 2))
CASES.append(("rk4v4-e8-gqa4-d128-batch", "rk4v4-e8", 8, 2, 128, [(130, 7), (0, 1), (63, 2)], 3))
CASES.append(("rk4v4-e8-gqa8-d64-tiles", "rk4v4-e8", 8, 1, 64, [(0, 40)], 4))
CASES.append(("int8-gqa4-d64-tiles", "int8", 4, 1, 64, [(10, 40)], 5))
CASES.append(("rk4v4-gqa6-d256-prefix", "rk4v4", 12, 2, 256, [(100, 5)], 6))
# explicit tilings (kwargs of paged_prefill_triton): several KV tiles per page, several query tiles
CASES.append(("rk4v4-e8-gqa6-d128-tiles16", "rk4v4-e8", 6, 1, 128, [(40, 30)], 7,
              {"block_m": 16, "block_n": 16, "num_warps": 2}))
CASES.append(("int8-gqa4-d256-bm128", "int8", 8, 2, 256, [(3, 33), (70, 2)], 8, {"block_m": 128, "block_n": 32}))
# the previous D=256 default tiling (the defaults are now 128 rows) and a small-tile int8 D=128 one
CASES.append(("rk4v4-e8-gqa6-d256-bm32", "rk4v4-e8", 6, 1, 256, [(90, 20)], 9, {"block_m": 32, "block_n": 16}))
CASES.append(("int8-gqa4-d128-bn16", "int8", 4, 1, 128, [(50, 30)], 10, {"block_m": 64, "block_n": 16, "num_warps": 4}))


def _run_case(name, fmt_name, hq, hkv, d, seqs, seed, tiling=None):
    import torch

    from ninfer.kernels.prefill import paged_prefill_ref, paged_prefill_triton as paged_prefill
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    gen = torch.Generator().manual_seed(seed)
    page = 64
    model_dtype = torch.bfloat16
    lens = [c + n for c, n in seqs]
    pages_per_seq = [-(-n // page) for n in lens]
    num_pages = sum(pages_per_seq) + 2
    planes = {}
    for which in ("k", "v"):
        x = torch.randn(num_pages, hkv, page, d, generator=gen)
        x[..., : d // 16] *= 4.0  # a few outlier channels, like real K
        data, sc = fmt.encode(x.to(model_dtype))
        planes[which] = data.to(fmt.data_dtype(model_dtype)).contiguous()
        if sc is not None:
            planes[f"{which}_scale"] = sc.contiguous()
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.full((len(seqs), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    pos = 0
    for b, npg in enumerate(pages_per_seq):
        bt[b, :npg] = perm[pos:pos + npg].to(torch.int32)
        pos += npg
        last, used = int(bt[b, npg - 1]), lens[b] - (npg - 1) * page
        for name_ in planes:  # poison the slots after the sequence end in its last page
            p = planes[name_]
            if p.is_floating_point():
                p[last, :, used:] = float("nan") if name_ in ("k", "v", "k_scale") else float("inf")
            else:
                p[last, :, used:] = torch.randint(0, 100, p[last, :, used:].shape, generator=gen).to(p.dtype)
    qlens = [n for _, n in seqs]
    t = sum(qlens)
    q = torch.randn(t, hq, d, generator=gen).to(model_dtype)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    sl = torch.tensor(lens, dtype=torch.int32)
    kp = (planes["k"], planes.get("k_scale"))
    vp = (planes["v"], planes.get("v_scale"))
    out = torch.full((t, hq, d), float("nan"), dtype=model_dtype)
    scale = d ** -0.5
    args = (q, kp, vp, qsl, sl, bt, max(qlens), fmt, scale)
    paged_prefill(*args, out=out, exact_dots=True, **(tiling or {}))
    gpu = paged_prefill(*args, **(tiling or {})).float() if fmt.has_scales else None
    # The kernel's scaled-format tiles are fp16 s*code (one rounding): the tight reference rounds alike.
    ref = paged_prefill_ref(q.float(), kp, vp, qsl, sl, bt, max(qlens), fmt, scale,
                            kv_round=torch.float16 if fmt.has_scales else None)
    exact = paged_prefill_ref(q.float(), kp, vp, qsl, sl, bt, max(qlens), fmt, scale)
    o = out.float()
    finite = bool(torch.isfinite(o).all())
    excess = float(((o - ref).abs() - (2.0 ** -8 * ref.abs() + 1e-5)).max()) if finite else float("nan")
    rel = float((o - exact).norm() / exact.norm()) if finite else float("nan")
    res = {"name": name, "finite": finite, "excess": excess, "rel": rel}
    if gpu is not None:  # fp16 operands as on the GPU: Q and P rounded to fp16 too
        res["gpu_finite"] = bool(torch.isfinite(gpu).all())
        res["gpu_excess"] = float(((gpu - ref).abs() - (2.0 ** -8 * ref.abs() + 2e-3 * ref.abs().max())).max())
        res["gpu_rel"] = float((gpu - exact).norm() / exact.norm())
    return res


def _child() -> int:
    return child_main(CASES, _run_case)


results = module_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_prefill_matches_reference(results, case):
    r = case_result(results, case[0])
    assert r["finite"], "NaN/Inf in the output: an element was not written, or poison leaked in"
    assert r["excess"] <= 0, f"error above 2^-8 relative + 1e-5 by {r['excess']:.3e} (rel {r['rel']:.2e})"
    assert r["rel"] <= 5e-3, f"relative error {r['rel']:.2e} vs the unrounded reference"
    if "gpu_rel" in r:
        assert r["gpu_finite"] and r["gpu_excess"] <= 0 and r["gpu_rel"] <= 5e-3, f"fp16-operand path: {r}"


def test_word_order_matches_the_nibble_layout():
    """The kernels' word-ordered rotated domain is e8.to_blocks(rotate(x)) flattened (g, w, j), and
    rotating Q and K into it leaves scores unchanged (pure torch, no Triton)."""
    import torch

    from ninfer.kernels.hadamard import from_word_domain, to_word_domain
    from ninfer.kvcache.e8 import to_blocks
    from ninfer.kvcache.hadamard import rotate

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=gen, dtype=torch.float64)
    y = torch.randn(7, 256, generator=gen, dtype=torch.float64)
    wx = to_word_domain(x)
    assert torch.allclose(wx, to_blocks(rotate(x)).reshape(5, 256).float(), atol=1e-5)
    assert torch.allclose(from_word_domain(wx), x.float(), atol=1e-5)
    assert torch.allclose(wx @ to_word_domain(y).T, (x @ y.T).float(), atol=1e-4)


def test_paged_prefill_rejects_bad_inputs():
    import torch

    from ninfer.kernels.prefill import paged_prefill_triton as paged_prefill
    from ninfer.kvcache.formats import get_format

    e8, int8 = get_format("rk4v4-e8"), get_format("int8")

    q = torch.zeros(3, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 64, 64, dtype=torch.uint8)
    ks = torch.zeros(2, 2, 64, 2, dtype=torch.float16)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    sl = torch.tensor([3], dtype=torch.int32)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError):
        paged_prefill(q, (k, None), (k, ks), qsl, sl, bt, 3, e8, 0.1)  # missing scale
    with pytest.raises(ValueError):
        paged_prefill(q[:, :3], (k, ks), (k, ks), qsl, sl, bt, 3, e8, 0.1)  # 3 q heads, 2 kv heads
    with pytest.raises(ValueError):
        paged_prefill(q, (k, ks), (k, ks), qsl, sl, bt, 3, int8, 0.1)  # int8 extent is D
    with pytest.raises(ValueError):
        paged_prefill(q, (k, ks), (k, ks), qsl[:1], sl, bt, 3, e8, 0.1)  # query_start_loc
    with pytest.raises(ValueError):
        paged_prefill(q, (k, ks), (k, ks), qsl, sl.long(), bt, 3, e8, 0.1)  # seq_lens dtype


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
