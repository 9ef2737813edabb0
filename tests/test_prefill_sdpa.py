"""The SDPA prefill path (ninfer/attention/prefill_sdpa.py, ninfer/kernels/dequant_pages.py) on CPU.

Reference: ReferenceAttentionBackend (torch, float32, un-rotated decode of what is stored).

In process (SDPA = aten's CPU flash kernel, dequantize = its torch oracle): every format,
D 64/128/256, GQA 1/4/6/8, varlen batches of a long chunk over a cached prefix that is not
page-aligned plus a sequence starting empty, KV chunks smaller than the context (so partial results
are merged by log-sum-exp), three seeds. float32 queries must match to 1e-5 (the path is exact
up to summation order: rotation in the stored domain, GQA fold, merge); bf16 queries within bf16
rounding (<= 1.5e-2; measured 2e-3..4e-3).

Interpreter child (TRITON_INTERPRET=1, tests/triton_interp.py): the Triton dequantize kernel
bit-exact against its torch oracle (float32 and bf16 workspaces; rows past the range untouched),
and the kernel backend with ``prefill=sdpa`` over two engine steps (a prefill of two sequences, a
mixed step of one decode row and a 19-token chunk crossing pages) against ReferenceAttentionBackend,
with byte-identical pools after every step; the Q fold / merge kernels against their oracles.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.triton_interp import FORMATS, case_result, child_main, exact_values, module_results  # noqa: E402

PAGE = 16
SHAPES = [(4, 4, 64), (8, 2, 128), (6, 1, 256), (8, 1, 64)]  # (Hq, Hkv, D): GQA 1, 4, 6, 8


def _meta(qlens, seq_lens, tables, width):
    from tests.step_meta import make_meta
    return make_meta(qlens, seq_lens, tables, width, PAGE)


def _two_steps(fmt, hq, hkv, d, seed, qdt, run):
    """Step 1 stores a 37-token prefix of A; step 2 is a varlen batch: A's 29-token chunk (crossing
    pages 2..4) and B's first 21 tokens. Returns (rel error of step 2, of step 1)."""
    import torch

    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.kvcache.pool import KVCachePool

    gen = torch.Generator().manual_seed(seed)
    pool = KVCachePool(fmt, 1, hkv, d, 8, PAGE, "cpu", torch.bfloat16)
    ref = ReferenceAttentionBackend(pool)
    perm = torch.randperm(8, generator=gen).tolist()
    tables = [perm[:5], perm[5:7]]
    rels = []
    for qlens, seq_lens in (([37], [37]), ([29, 21], [66, 21])):
        used = [tb[: -(-n // PAGE)] for tb, n in zip(tables, seq_lens)]
        meta = _meta(qlens, seq_lens, used, 5)
        t = sum(qlens)
        q = torch.randn(t, hq, d, generator=gen).to(qdt)
        k = (torch.randn(t, hkv, d, generator=gen) * 2).to(torch.bfloat16)
        v = torch.randn(t, hkv, d, generator=gen).to(torch.bfloat16)
        o_ref = ref.forward(0, q, k, v, meta, d ** -0.5).float()  # stores, then attends
        o = run(q, pool, meta, d ** -0.5).float()
        rels.append(float((o - o_ref).norm() / o_ref.norm()))
    return rels[::-1]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-D{s[2]}")
def test_prefill_sdpa_matches_reference(fmt, shape):
    import torch

    from ninfer.attention.prefill_sdpa import prefill_sdpa

    def run(q, pool, meta, scale):
        return prefill_sdpa(q, pool.layers[0], fmt, meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables,
                            scale, kv_chunk=16, torch_ops=True, ws_dtype=q.dtype)

    for seed in range(3):
        hq, hkv, d = shape
        rels32 = _two_steps(fmt, hq, hkv, d, seed, torch.float32, run)
        assert max(rels32) <= 1e-5, f"float32 seed {seed}: {rels32}"
        rels16 = _two_steps(fmt, hq, hkv, d, seed + 10, torch.bfloat16, run)
        assert max(rels16) <= 1.5e-2, f"bf16 seed {seed}: {rels16}"


def test_prefill_sdpa_refuses_bad_shapes():
    import torch

    from ninfer.attention.prefill_sdpa import prefill_sdpa
    from ninfer.kvcache.pool import KVCachePool

    pool = KVCachePool("int8", 1, 2, 64, 4, PAGE, "cpu", torch.bfloat16)
    bt = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree"):
        prefill_sdpa(torch.zeros(5, 3, 64), pool.layers[0], "int8", [5], [5], bt, 0.1)
    with pytest.raises(ValueError, match="new tokens"):
        prefill_sdpa(torch.zeros(5, 4, 64), pool.layers[0], "int8", [5], [4], bt, 0.1)


def test_merge_by_lse_equals_one_softmax():
    """Merging two halves by log-sum-exp equals attention over the whole key set (float64)."""
    import torch

    from ninfer.attention.prefill_sdpa import _merge, sdpa_lse

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g, dtype=torch.float64) for n in (7, 50, 50))
    acc: list = []
    for sl in (slice(0, 19), slice(19, 50)):
        o, lse = sdpa_lse(q, k[:, :, sl], v[:, :, sl], False, 0.125)
        _merge(acc, o[0], lse[0])
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v
    assert float((acc[0] - ref[0]).abs().max()) < 1e-10


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(32, 8, 128), (24, 4, 256)], ids=["32q8kv-D128", "24q4kv-D256"])
def test_gpu_prefill_sdpa_matches_reference_within_its_workspace(fmt, shape):
    """On a GPU: a 1000-token chunk over 5000 cached tokens (3 KV chunks of 2048 merged) and a fresh
    777-token sequence, cuDNN or flash, against the float32 oracle; the peak allocation above the
    inputs stays within ``workspace_bytes``."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.attention.prefill_sdpa import prefill_sdpa, workspace_bytes
    from ninfer.kernels.prefill import paged_prefill_ref
    from ninfer.kernels.store_kv import store_kv_triton
    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.pool import KVCachePool

    hq, hkv, d = shape
    dev, page = torch.device("cuda"), 64
    g = torch.Generator(device=dev).manual_seed(hq + d)
    qlens, sl = [1000, 777], [6000, 777]
    pages = [-(-n // page) for n in sl]
    pool = KVCachePool(fmt, 1, hkv, d, sum(pages), page, dev, torch.bfloat16)
    planes = pool.layers[0]
    perm = torch.randperm(sum(pages), device=dev, generator=g).to(torch.int32)
    bt = torch.full((2, max(pages)), -1, dtype=torch.int32, device=dev)
    bt[0, :pages[0]], bt[1, :pages[1]] = perm[:pages[0]], perm[pages[0]:]
    for b in range(2):
        t = torch.arange(sl[b], device=dev)
        kv = torch.randn(2, sl[b], hkv, d, device=dev, generator=g).to(torch.bfloat16)
        store_kv_triton(kv[0], kv[1], planes, bt[b].long()[t // page] * page + t % page, get_format(fmt))
    q = torch.randn(sum(qlens), hq, d, device=dev, generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0, 1000, 1777], dtype=torch.int32, device=dev)
    ref = paged_prefill_ref(q.float(), planes, planes, qsl, torch.tensor(sl, dtype=torch.int32, device=dev), bt,
                            1000, get_format(fmt), d ** -0.5).float()
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prefill_sdpa(q, planes, fmt, qlens, sl, bt, d ** -0.5, out=out, kv_chunk=2048)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= workspace_bytes(hq, hkv, d, 1000, kv_chunk=2048)
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel <= 1e-2, rel


# --------------------------------------------------------------------------- interpreter child
CHILD_CASES = [(f"dequant-{f}", f, 200 + i) for i, f in enumerate(FORMATS)] + \
              [(f"backend-{f}", f, 300 + i) for i, f in enumerate(FORMATS)] + [("io", "", 400)]


def _dequant_case(name, fmt, seed):
    import torch

    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.kernels.dequant_pages import dequant_pages, dequant_pages_ref
    from ninfer.kvcache.pool import KVCachePool

    gen = torch.Generator().manual_seed(seed)
    res = {"name": name, "exact": [], "untouched": []}
    for hkv, d in ((1, 64), (2, 128), (1, 256)):
        pool = KVCachePool(fmt, 1, hkv, d, 8, PAGE, "cpu", torch.bfloat16)
        bt = torch.randperm(8, generator=gen).to(torch.int32)
        n = 100
        slots = torch.tensor([int(bt[i // PAGE]) * PAGE + i % PAGE for i in range(n)])
        ReferenceAttentionBackend(pool).store(0, torch.randn(n, hkv, d, generator=gen) * 3,
                                              torch.randn(n, hkv, d, generator=gen), slots)
        for dt in (torch.float32, torch.bfloat16):
            k = torch.full((hkv, 80, d), float("nan"), dtype=dt)
            v = k.clone()
            dequant_pages(pool.layers[0], fmt, bt, 13, 70, k, v, block_n=32)  # 3 programs, the last partial
            kr, vr = dequant_pages_ref(pool.layers[0], fmt, bt, 13, 70, dt)
            res["exact"].append(bool(torch.equal(k[:, :70], kr) and torch.equal(v[:, :70], vr)))
            res["untouched"].append(bool(k[:, 70:].isnan().all() and v[:, 70:].isnan().all()))
    return res


def _backend_case(name, fmt, seed):
    import torch

    from ninfer.attention import prefill_sdpa as PS
    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.attention.selector import select_backend
    from ninfer.kvcache.pool import KVCachePool

    hq, hkv, d = 4, 1, 64
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    pools = [KVCachePool(fmt, 1, hkv, d, 8, PAGE, "cpu", dt) for _ in range(2)]
    PS.MIN_CHUNK = 2  # the 1-token mixed step stays on SDPA too (the Triton kernel serves shorter steps)
    sdpa = select_backend(pools[0], "cpu", dt, hq, force={"prefill": "sdpa"}, num_splits=2)
    ref = ReferenceAttentionBackend(pools[1])
    perm = torch.randperm(8, generator=gen).tolist()
    tables = [perm[:5], perm[5:7]]
    steps = [([40, 5], [40, 5]), ([1, 19], [41, 24])]  # decode steps: tests/test_triton_backend.py
    res = {"name": name, "rel": [], "planes_equal": [], "paths": sdpa.kernel_paths()}
    for qlens, seq_lens in steps:
        used = [tb[: -(-n // PAGE)] for tb, n in zip(tables, seq_lens)]
        meta = _meta(qlens, seq_lens, used, 5)
        t = sum(qlens)
        # exact in bf16, but a dynamic range of 2^3 per group, not 2^12: the SDPA operands are bf16
        # (rotated Q, decoded K), and logits in the thousands would turn their 2^-9 rounding into a
        # different softmax winner against the float32 reference
        q = exact_values(gen, (t, hq, d), dt, lo=-3, hi=0)
        k, v = exact_values(gen, (t, hkv, d), dt, lo=-3, hi=0), exact_values(gen, (t, hkv, d), dt, lo=-3, hi=0)
        o_s = sdpa.forward(0, q, k, v, meta, d ** -0.5).float()
        o_r = ref.forward(0, q, k, v, meta, d ** -0.5).float()
        res["rel"].append(float((o_s - o_r).norm() / o_r.norm()) if bool(torch.isfinite(o_s).all()) else float("nan"))
        a, b = pools[0].layers[0], pools[1].layers[0]
        res["planes_equal"].append(all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a))
    return res


def _io_case(name, _fmt, seed):
    """fold_q / merge_out kernels against their float64-merging torch oracles: max abs error."""
    import torch

    from ninfer.kernels import sdpa_io as IO

    gen = torch.Generator().manual_seed(seed)
    res = {"name": name, "fold": [], "merge": []}
    for rot in (False, True):
        for hq, hkv, d, t in SHAPES_IO:
            q = torch.randn(t, hq, d, generator=gen).to(torch.bfloat16)
            for dt in (torch.float32, torch.bfloat16):
                res["fold"].append(float((IO.fold_q(q, rot, dt).float() - IO.fold_q_ref(q, rot, dt).float()).abs().max()))
            g = hq // hkv
            o1 = torch.randn(hkv, g * t, d, generator=gen).to(torch.bfloat16)  # folded
            o2 = torch.randn(hq, t, d, generator=gen).to(torch.bfloat16)  # per head
            l1, l2 = torch.randn(hkv, g * t, generator=gen) * 4, torch.randn(hq, t, generator=gen) * 4
            for parts in ([(o1, l1, True)], [(o1, l1, True), (o2, l2, False)], [(o2, l2, False)]):
                out = torch.full((t, hq, d), float("nan"))
                ref = out.clone()
                IO.merge_out(parts, out, g, rot)
                IO.merge_out_ref(parts, ref, g, rot)
                res["merge"].append(float((out - ref).abs().max()))
    return res


SHAPES_IO = [(4, 4, 64, 37), (8, 2, 128, 45), (6, 1, 256, 33)]


def _run_case(name, fmt, seed):
    run = {"dequant": _dequant_case, "backend": _backend_case, "io": _io_case}[name.split("-")[0]]
    return run(name, fmt, seed)


def _child() -> int:
    return child_main(CHILD_CASES, _run_case)


results = module_results(__file__)


@pytest.mark.slow  # the module's interpreter child: ~1 min on a 2-core machine
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_kernel_bit_exact(results, fmt):
    r = case_result(results, f"dequant-{fmt}")
    assert all(r["exact"]), r
    assert all(r["untouched"]), r


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_sdpa_backend_matches_reference(results, fmt):
    r = case_result(results, f"backend-{fmt}")
    assert "prefill=sdpa" in r["paths"], r["paths"]
    assert all(r["planes_equal"]), r
    assert all(x <= 1e-2 for x in r["rel"]), r


@pytest.mark.slow
def test_fold_and_merge_kernels(results):
    r = case_result(results, "io")
    assert max(r["fold"]) <= 1e-6, r["fold"]  # bf16 outputs: the same rounding of the same float32 value
    assert max(r["merge"]) <= 1e-5, r["merge"]  # float32 outputs of float32 merges of |o| < 5


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
