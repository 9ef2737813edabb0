"""TritonAttentionBackend vs ReferenceAttentionBackend over three steps, every format, on CPU.

Interpreter: one child process with ``TRITON_INTERPRET=1`` (see tests/triton_interp.py).

Steps on two sequences with shuffled pages: (1) prefill 70 + 5 tokens (a chunk crossing a page
boundary); (2) a mixed step -- sequence A decodes one token while B prefills a 3-token chunk
(the prefill kernel path with a 1-token query); (3) a pure decode step (``is_decode``, block
tables padded to the full width: the CUDA-graph shape, through the decode op). After every
step both pools must be byte-identical (store is bit-exact for these exactly-rotatable inputs)
and the outputs must agree: ``rel = ||out - ref|| / ||ref|| <= 1e-2`` (the decode kernel rounds
dot operands to fp16/bf16; the prefill kernel under the interpreter only rounds the output).

Also: decode CUDA graphs (ninfer/engine/cuda_graphs.py) replayed vs eager on a GPU (``cuda``
marker; skipped on CPU), and refusal to capture on a CPU runner.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.triton_interp import FORMATS, child_main, exact_values, case_result, module_results  # noqa: E402

CASES = [(f, 100 + i) for i, f in enumerate(FORMATS)]  # (format, seed); the format names the case

HQ, HKV, D, PAGE, NUM_PAGES, WIDTH = 4, 2, 64, 64, 6, 4


def _meta(qlens, seq_lens, tables, width):
    from tests.step_meta import make_meta
    return make_meta(qlens, seq_lens, tables, width, PAGE)


def _run_case(fmt_name, seed):
    import torch

    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.attention.triton_backend import TritonAttentionBackend
    from ninfer.kvcache.pool import KVCachePool

    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    pools = [KVCachePool(fmt_name, 1, HKV, D, NUM_PAGES, PAGE, "cpu", dt) for _ in range(2)]
    tri, ref = TritonAttentionBackend(pools[0], num_splits=2), ReferenceAttentionBackend(pools[1])
    perm = torch.randperm(NUM_PAGES, generator=gen).tolist()
    tables = [perm[:3], perm[3:4]]
    steps = [([70, 5], [70, 5], 0), ([1, 3], [71, 8], 0), ([1, 1], [72, 9], WIDTH)]
    res = {"name": fmt_name, "rel": [], "planes_equal": [], "decode_flags": []}
    for qlens, seq_lens, width in steps:
        used = [tb[: -(-n // PAGE)] for tb, n in zip(tables, seq_lens)]
        meta = _meta(qlens, seq_lens, used, width or max(len(u) for u in used))
        t = sum(qlens)
        q = exact_values(gen, (t, HQ, D), dt)
        k, v = exact_values(gen, (t, HKV, D), dt), exact_values(gen, (t, HKV, D), dt)
        o_t = tri.forward(0, q, k, v, meta, D ** -0.5).float()
        o_r = ref.forward(0, q, k, v, meta, D ** -0.5).float()
        res["rel"].append(float((o_t - o_r).norm() / o_r.norm()) if bool(torch.isfinite(o_t).all()) else float("nan"))
        a, b = pools[0].layers[0], pools[1].layers[0]
        res["planes_equal"].append(all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a))
        res["decode_flags"].append(meta.is_decode)
    return res


def _child() -> int:
    return child_main(CASES, _run_case)


results = module_results(__file__)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_backend_matches_reference(results, fmt):
    r = case_result(results, fmt)
    assert r["decode_flags"] == [False, False, True]
    assert all(r["planes_equal"]), f"pools differ after steps: {r['planes_equal']}"
    assert all(x <= 1e-2 for x in r["rel"]), f"relative errors per step {r['rel']}"


class _TinyAttnModel:
    """Embedding -> one attention layer through the backend -> flatten (enough to drive the seam)."""

    def __init__(self, device):
        import torch

        g = torch.Generator().manual_seed(0)
        self.emb = (torch.randn(512, HQ * D, generator=g) * 0.5).to(device=device, dtype=torch.bfloat16)

    def __call__(self, input_ids, positions, meta, backend):
        x = self.emb[input_ids] * (1.0 + positions[:, None].to(self.emb.dtype) * 1e-3)
        t = x.shape[0]
        q = x.view(t, HQ, D)
        k, v = q[:, :HKV].contiguous(), q[:, HKV:2 * HKV].contiguous()
        return backend.forward(0, q, k, v, meta, D ** -0.5).reshape(t, HQ * D)


def test_capture_refuses_cpu_runner():
    import torch

    from ninfer.engine.cuda_graphs import capture_decode_graphs
    from ninfer.engine.model_runner import ModelRunner

    runner = ModelRunner(_TinyAttnModel("cpu"), None, device=torch.device("cpu"), page_size=PAGE, max_pages_per_seq=WIDTH)
    with pytest.raises(RuntimeError):
        capture_decode_graphs(runner, [1, 2])


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "int8", "rk4v4-e8"])
def test_decode_graphs_replay_matches_eager(fmt):
    """On a GPU: graphs for buckets 1, 2, 4; a 3-sequence decode step replayed in bucket 4 equals
    the eager step, the padding row stores nothing, the observed graph memory is reported."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.attention.triton_backend import TritonAttentionBackend
    from ninfer.engine.cuda_graphs import capture_decode_graphs
    from ninfer.engine.model_runner import ModelRunner
    from ninfer.kvcache.pool import KVCachePool

    dev = torch.device("cuda")
    pool = KVCachePool(fmt, 1, HKV, D, NUM_PAGES, PAGE, dev, torch.bfloat16)
    runner = ModelRunner(_TinyAttnModel(dev), TritonAttentionBackend(pool), device=dev, page_size=PAGE,
                         max_pages_per_seq=WIDTH)
    observed = capture_decode_graphs(runner, [1, 2, 4])
    assert observed > 0 and runner.forward_fn is not runner.eager_forward
    tables = [[0, 1], [2], [3, 4]]
    lens = [70, 9, 100]
    for b, (tb, n) in enumerate(zip(tables, lens)):  # fill the prefixes eagerly
        meta = _meta([n - 1], [n - 1], [tb], WIDTH)
        runner.eager_forward(torch.arange(n - 1, device=dev) % 512, torch.arange(n - 1, device=dev),
                             _to(meta, dev))
    meta = _to(_meta([1, 1, 1], lens, tables, WIDTH), dev)
    ids = torch.tensor([5, 6, 7], device=dev)
    pos = torch.tensor([n - 1 for n in lens], device=dev)
    before = {n: t.clone() for n, t in pool.layers[0].items()}
    out_graph = runner.forward_fn(ids, pos, meta).clone()
    after_graph = {n: t.clone() for n, t in pool.layers[0].items()}
    for n in before:  # restore, then run the same step eagerly
        pool.layers[0][n].copy_(before[n])
    out_eager = runner.eager_forward(ids, pos, meta)
    torch.cuda.synchronize()
    # bucket 4 vs batch 3 may pick different KV split counts: equal up to summation order
    rel = float((out_graph.float() - out_eager.float()).norm() / out_eager.float().norm())
    assert rel <= 1e-2, rel
    for n in before:
        assert torch.equal(after_graph[n], pool.layers[0][n]), f"plane {n} differs between graph and eager"


def _to(meta, dev):
    from dataclasses import replace

    return replace(meta, slot_mapping=meta.slot_mapping.to(dev), query_start_loc=meta.query_start_loc.to(dev),
                   seq_lens=meta.seq_lens.to(dev), block_tables=meta.block_tables.to(dev))


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
