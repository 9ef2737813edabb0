"""Paged decode kernels (ninfer/kernels/paged_decode.py) vs their torch oracle, on CPU.

How the interpreter is enabled: Triton decides at ``@triton.jit`` time (module import) whether a
kernel is interpreted, and other test modules may already have imported Triton or the kernel
modules in this pytest process. So the checks run in ONE child process started with
``TRITON_INTERPRET=1`` in its environment (``python tests/test_kernel_decode.py --child``); it
runs every case and prints one JSON line per case; the tests here assert on those lines. This is
independent of test order, of conftest files and of what the parent imported.

What is checked, per case (fresh random inputs from the case's seed; all formats):
* every output element written (the output buffer is poisoned with NaN first);
* ``||out - ref|| / ||ref|| <= tol`` with ``ref = paged_decode_ref`` (planes decoded by the format
  registry's reference decode, float64 attention);
* odd lengths, lengths at / across page boundaries, a batch with different lengths (one of them
  0), GQA 1 / 4 / 6, head_dim 128 and 256, shuffled (non-contiguous) block tables, several splits.

Tolerances: the kernel feeds fp16 (quantized formats) or bf16 (bf16 planes) operands to the
dots and rounds P to fp16/bf16 before the PV product, everything else in float32; the
reference decodes the *same* stored codes, so quantization error is not part of the comparison.
bf16 operands carry ~2^-9 relative rounding per element -> observed relative error a few 1e-3;
fp16 ~2^-12 -> ~1e-3. Bounds: 2e-2 for bf16 planes, 1e-2 otherwise (a wrong nibble, a missed
coset bit or a wrong page gives errors of order 1e-1 .. 1).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.triton_interp import child_main, case_result, module_results  # noqa: E402
FORMATS = ("auto", "bf16", "int8", "rk4v4", "rk4v4-e8")

# (name, fmt, hq, hkv, d, lens, page, splits, seed)
CASES = []
for _f in FORMATS:
    CASES.append((f"{_f}-gqa6-d256", _f, 6, 1, 256, [131], 64, 2, 1))
    CASES.append((f"{_f}-gqa4-d128-batch", _f, 8, 2, 128, [1, 64, 0, 200], 64, 3, 2))
for _f in ("int8", "rk4v4", "rk4v4-e8"):
    CASES.append((f"{_f}-gqa1-d128-page16", _f, 2, 2, 128, [17, 48], 16, 2, 3))
CASES.append(("rk4v4-e8-gqa4-d128-seed4", "rk4v4-e8", 4, 1, 128, [65, 127], 64, 1, 4))
for _f in FORMATS:
    CASES.append((f"{_f}-gqa3-d64", _f, 9, 3, 64, [70, 5], 64, 2, 6))
CASES.append(("rk4v4-e8-gqa6-d256-seed5", "rk4v4-e8", 12, 2, 256, [192], 64, 5, 5))

TOL = {"auto": 2e-2, "bf16": 2e-2}


def _run_case(name, fmt_name, hq, hkv, d, lens, page, splits, seed):
    import torch

    from ninfer.kernels.paged_decode import paged_decode_ref, paged_decode_triton
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    gen = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    pages_per_seq = [max(1, -(-n // page)) for n in lens]
    num_pages = sum(pages_per_seq) + 3
    model_dtype = torch.bfloat16
    planes = {}
    for pl in fmt.planes(d, model_dtype):
        planes[pl.name] = torch.zeros(num_pages, hkv, page, pl.extent, dtype=pl.dtype)
    # Random page ids: each sequence gets a shuffled, non-contiguous set of pages.
    perm = torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per_seq) + 1
    bt = torch.full((bsz, max_pages), -1, dtype=torch.int32)
    pos = 0
    for b, npg in enumerate(pages_per_seq):
        bt[b, :npg] = perm[pos:pos + npg].to(torch.int32)
        pos += npg
    # Fill every page of the pool with encoded random K/V (also pages nobody reads).
    for which in ("k", "v"):
        x = torch.randn(num_pages, hkv, page, d, generator=gen)
        # a few outlier channels, like real K
        x[..., : d // 16] *= 4.0
        data, sc = fmt.encode(x.to(model_dtype))
        planes[which].copy_(data.to(planes[which].dtype))
        if sc is not None:
            planes[f"{which}_scale"].copy_(sc)
    q = torch.randn(bsz, hq, d, generator=gen).to(model_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((bsz, hq, d), float("nan"), dtype=model_dtype)
    scale = d ** -0.5
    kp = (planes["k"], planes.get("k_scale"))
    vp = (planes["v"], planes.get("v_scale"))
    paged_decode_triton(q, kp, vp, bt, seq_lens, fmt, scale, num_splits=splits, out=out)
    ref = paged_decode_ref(q, kp, vp, bt, seq_lens, fmt, scale)
    o = out.to(torch.float32)
    finite = bool(torch.isfinite(o).all())
    rel = float((o - ref).norm() / ref.norm().clamp_min(1e-30)) if finite else float("nan")
    empty_ok = all(bool((o[b] == 0).all()) for b, n in enumerate(lens) if n == 0)
    return {"name": name, "finite": finite, "rel": rel, "empty_ok": empty_ok}


def _child() -> int:
    return child_main(CASES, _run_case)


results = module_results(__file__)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_decode_matches_reference(results, case):
    r = case_result(results, case[0])
    assert r["finite"], "NaN/Inf in output: some element was not written"
    assert r["empty_ok"], "a zero-length sequence must give zeros"
    tol = TOL.get(case[1], 1e-2)
    assert r["rel"] <= tol, f"relative error {r['rel']:.3e} > {tol}"


def test_wrapper_rejects_bad_shapes():
    import torch

    from ninfer.kernels.paged_decode import paged_decode_cuda, paged_decode_triton as paged_decode
    from ninfer.kvcache.formats import get_format

    e8, int8 = get_format("rk4v4-e8"), get_format("int8")
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 1, 64, 64, dtype=torch.uint8)
    ks = torch.zeros(2, 1, 64, 2, dtype=torch.float16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError):
        paged_decode(q, (k, ks), (k, ks), bt, sl.long(), e8, 0.1)  # seq_lens dtype
    with pytest.raises(ValueError):
        paged_decode(q, (k, None), (k, ks), bt, sl, e8, 0.1)  # missing scale
    with pytest.raises(ValueError):
        paged_decode(q, (k.view(torch.int8), ks), (k, ks), bt, sl, e8, 0.1)  # dtype
    with pytest.raises(ValueError):
        paged_decode(q[:, :3], (k, ks), (k, ks), bt, sl, int8, 0.1)  # int8 extent is D
    with pytest.raises(TypeError, match="format object"):
        paged_decode(q, (k, ks), (k, ks), bt, sl, "rk4v4-e8", 0.1)  # a name, not the format
    with pytest.raises(ValueError, match="paged_decode_cuda: not on CUDA"):
        paged_decode_cuda(q, (k, ks), (k, ks), bt, sl, e8, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(q, (k, ks), (k, ks), bt, sl, e8, 0.1, num_splits=0)


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
