"""rk4v4-e8w's window partial as a kernel of its own (``window_partial``, which the CUDA path runs on
a second stream beside its split kernel) merged by ``decode_reduce(partial=...)``: equal to the fused tail inside the
reduction and to the torch oracle, ring write included (Triton under the interpreter, in a child)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.triton_interp import case_result, child_main, module_results  # noqa: E402

W = 128
CASES = [("natural-splits", False, 3), ("rotated-splits", True, 3), ("natural-tail-only", False, 1)]


def _case(name: str, rotated: bool, splits: int) -> dict:
    from ninfer.kernels.decode_reduce import decode_reduce
    from ninfer.kernels.window_attn import WindowTail, window_decode_ref, window_partial
    from ninfer.kvcache.hadamard import rotate
    gen = torch.Generator().manual_seed(3 + splits)
    ring = {n: torch.randn(3, 2, W, 128, generator=gen) for n in ("k", "v")}
    q = torch.randn(3, 6, 128, generator=gen)
    k, v = torch.randn(3, 2, 128, generator=gen), torch.randn(3, 2, 128, generator=gen)
    slots, lens = torch.tensor([2, 0, -1], dtype=torch.int32), torch.tensor([300, 5, 0], dtype=torch.int32)
    w = torch.tensor([128, 3, 0], dtype=torch.int32)
    mid_o = torch.randn(18, splits, 128, generator=gen)
    mid_lse = torch.randn(18, splits, generator=gen) * 4
    if splits == 1:
        mid_lse.fill_(float("-inf"))
    mid_lse[12:] = float("-inf")  # the padding row: nothing anywhere
    fused_ring = {n: t.clone() for n, t in ring.items()}
    fused = torch.empty(18, 128)
    decode_reduce(mid_o, mid_lse, fused, rotated=rotated, tail=WindowTail(q, k, v, fused_ring, slots, lens, w, 0.1))
    part = window_partial(WindowTail(q, k, v, ring, slots, lens, w, 0.1))
    out = torch.empty(18, 128)
    decode_reduce(mid_o, mid_lse, out, rotated=rotated, partial=part)
    o, lse = window_decode_ref(q, ring, slots, lens, w, 0.1)  # the ring after the partial's write
    # oracle: merge the splits and the window partial (log2 domain), then undo the rotation
    ow = rotate(o) if rotated else o
    lses = torch.cat([mid_lse, lse[:, None]], 1)
    m = lses.amax(1, keepdim=True).clamp(min=-1e30)
    wts = torch.exp2(lses - m)
    merged = (torch.cat([mid_o, ow[:, None]], 1) * wts[..., None]).sum(1) / wts.sum(1, keepdim=True).clamp(min=1e-30)
    ref = rotate(merged) if rotated else merged
    return {"name": name, "rel_ref": float((out - ref).norm() / ref.norm()),
            "rel_fused": float((out - fused).norm() / fused.norm()),
            "ring_same": all(torch.equal(ring[n], fused_ring[n]) for n in ring),
            "pad_zero": bool((out[12:] == 0).all()), "lse_pad": bool(torch.isinf(part[1][12:]).all())}


def _child() -> int:
    return child_main(CASES, _case)


results = module_results(__file__)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_window_partial_merges_like_the_fused_tail(results, name) -> None:
    r = case_result(results, name)
    assert r["rel_ref"] < 1e-5 and r["rel_fused"] < 1e-5, r
    assert r["ring_same"] and r["pad_zero"] and r["lse_pad"], r


@pytest.mark.cuda
def test_cuda_tail_on_a_second_stream_equals_the_fused_tail() -> None:
    """paged_decode_cuda (the window on a second stream), eager and replayed from a CUDA graph, against
    the same split kernel's partials merged with the tail fused into the reduction."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ninfer.kernels.decode_reduce import decode_reduce
    from ninfer.kernels.paged_decode import _paged_decode_cuda_split, default_cfg, paged_decode_cuda
    from ninfer.kernels.window_attn import WindowTail
    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.pool import KVCachePool
    dev, fmt, b, ctx, splits = torch.device("cuda"), get_format("rk4v4-e8w"), 2, 1000, 4
    pool = KVCachePool(fmt, 1, 8, 128, b * 17, 64, dev, torch.bfloat16, num_slots=b)
    g = torch.Generator(device=dev).manual_seed(0)
    for t in pool.layers[0].values():
        t.copy_(torch.randint(0, 256, t.shape, device=dev, dtype=torch.uint8, generator=g)) \
            if t.dtype == torch.uint8 else t.fill_(0.02)
    for t in pool.windows[0].values():
        t.normal_(generator=g)
    bt = torch.arange(b * 17, device=dev, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    w = torch.full((b,), W, device=dev, dtype=torch.int32)
    q = torch.randn(b, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, 8, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    slots = torch.arange(b, device=dev, dtype=torch.int32)
    scale = 128 ** -0.5
    pl = pool.layers[0]
    ring0 = {n: t.clone() for n, t in pool.windows[0].items()}

    def tail(ring: dict) -> WindowTail:
        return WindowTail(q, k, v, ring, slots, lens, w, scale)

    def run(ring: dict) -> torch.Tensor:
        return paged_decode_cuda(q, pl, pl, bt, lens - w, fmt, scale, num_splits=splits, tail=tail(ring))
    mid_o = torch.empty(b * 32, splits, 128, dtype=torch.float32, device=dev)
    mid_lse = torch.empty(b * 32, splits, dtype=torch.float32, device=dev)
    _paged_decode_cuda_split(q, pl["k"], pl["k_scale"], pl["v"], pl["v_scale"], bt, lens - w, mid_o, mid_lse,
                             fmt.kernel_code, scale, splits, default_cfg(fmt.kernel_code, 128))
    fused_ring = {n: t.clone() for n, t in ring0.items()}
    fused = decode_reduce(mid_o, mid_lse, torch.empty(b * 32, 128, device=dev, dtype=torch.bfloat16),
                          rotated=False, tail=tail(fused_ring)).view(b, 32, 128)
    eager_ring = {n: t.clone() for n, t in ring0.items()}
    eager = run(eager_ring)
    ring = {n: t.clone() for n, t in ring0.items()}
    run(ring)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(ring)
    graph.replay()
    torch.cuda.synchronize()
    for got in (eager, out):
        assert (got.float() - fused.float()).abs().max() <= 1e-2 * fused.float().abs().max()
    assert all(torch.equal(eager_ring[n], fused_ring[n]) and torch.equal(ring[n], fused_ring[n]) for n in ring)


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
