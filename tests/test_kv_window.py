"""rk4v4-e8w: rk4v4-e8 pages plus a model-dtype ring of each sequence's last W = 128 tokens' K/V.

* The reference backend (the executable spec) and the kernel backend (Triton store / decode with its
  window tail / SDPA prefill, under TRITON_INTERPRET=1 in a child process) against a float64 oracle
  built by hand: pages decoded for the positions before the window, the exact K/V for the rest
  (decode: the last min(W, L - v); prefill: the chunk plus min(W, C - v) cached). Lengths below, at
  and above W, chunks longer than W, GQA 1..6, D 64/128, and a reused prefix (v > 0) whose ring rows
  hold NaN (never written by the sequence: reading one would poison the output). Each case also
  checks that the pages-only answer is far off, so the window cannot be ignored unnoticed.
* The engine (CPU): next-token KL against unquantized KV well below rk4v4-e8's; aborts mid-prefill
  and mid-decode return every page and slot; prefix reuse reads the reused tokens from the pages
  (rings poisoned with NaN before the reusing request) and agrees with a run without reuse; a hybrid
  model with GDN states runs with the window; the plan counts the ring bytes the pool allocates.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.triton_interp import case_result, child_main, module_results  # noqa: E402

W = 128
PAGE = 64
# (name, hq, hkv, d, steps (new tokens per sequence per step), prefixes v, seed)
SCENARIOS = [
    ("short-gqa2-d64", 4, 2, 64, [[100], [1], [1], [1]], [0], 1),
    ("at-w-gqa6-d128", 6, 1, 128, [[127], [1], [1], [1]], [0], 2),
    ("long-chunk-gqa1-d64", 2, 2, 64, [[300], [1], [1]], [0], 3),
    ("prefix-mixed-gqa3-d64", 6, 2, 64, [[70, 100], [1, 100], [40, 1], [1, 1], [1, 1]], [128, 0], 4),
    ("prefix-decode-gqa4-d128", 4, 1, 128, [[1], [1], [90], [1]], [192], 5),
    ("kv-chunks-gqa2-d64", 4, 2, 64, [[150], [60], [1]], [0], 6),  # SDPA over 64-token KV chunks: the ring spans 3
]
CHILD = ["short-gqa2-d64", "prefix-mixed-gqa3-d64"]


def _oracle(pool, fmt, q, keys, vals, qlens, cur, starts, tables, decode, scale, window: bool):
    """float64 attention of the step: positions >= the window start read the exact K/V, the rest
    the decoded pages (window=False: everything from the pages, the answer that ignores the ring)."""
    planes = pool.layers[0]
    outs, t0 = [], 0
    hq, hkv = q.shape[1], keys.shape[2]
    for b, n in enumerate(qlens):
        c, length = cur[b], cur[b] + n
        pages = torch.tensor(tables[b][: -(-length // PAGE)], dtype=torch.long)

        def tok(x):
            y = x[pages]
            return y.permute(1, 0, 2, 3).reshape(y.shape[1], -1, y.shape[-1])[:, :length]
        k = fmt.decode(tok(planes["k"]), tok(planes["k_scale"]), dtype=torch.float64)
        v = fmt.decode(tok(planes["v"]), tok(planes["v_scale"]), dtype=torch.float64)
        if window:
            first = length - min(W, length - starts[b]) if decode else c - max(0, min(W, c - starts[b]))
            k[:, first:] = keys[b, first:length].transpose(0, 1).double()
            v[:, first:] = vals[b, first:length].transpose(0, 1).double()
        qb = q[t0:t0 + n].double().permute(1, 0, 2).reshape(hkv, hq // hkv, n, -1)
        s = torch.einsum("hgid,hjd->hgij", qb, k) * scale
        mask = torch.arange(length)[None, :] > (c + torch.arange(n))[:, None]
        p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        outs.append(torch.einsum("hgij,hjd->hgid", p, v).reshape(hq, n, -1).permute(1, 0, 2))
        t0 += n
    return torch.cat(outs)


def run_scenario(name, hq, hkv, d, steps, prefixes, seed, kind="reference", device="cpu", dtype=torch.float32,
                 force=None):
    """Drive one attention layer through the steps; per step the relative error against the oracle
    and against the pages-only answer. ``kind="kernels"``: the kernel backend (``force``: op choices)."""
    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.attention.selector import select_backend
    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.pool import KVCachePool
    from tests.step_meta import make_meta

    fmt = get_format("rk4v4-e8w")
    gen = torch.Generator().manual_seed(seed)
    bsz = len(prefixes)
    total = [p + sum(s[b] for s in steps) for b, p in enumerate(prefixes)]
    npg = [-(-t // PAGE) for t in total]
    perm = torch.randperm(sum(npg) + 2, generator=gen).tolist()
    tables = [perm[sum(npg[:b]):sum(npg[:b + 1])] for b in range(bsz)]
    pool = KVCachePool(fmt, 1, hkv, d, sum(npg) + 2, PAGE, device, dtype, num_slots=bsz + 2)
    for ring in pool.windows[0].values():
        ring.fill_(float("nan"))  # a row the sequence did not write must never be read
    slots = [bsz + 1 - b for b in range(bsz)]
    keys = torch.randn(bsz, max(total), hkv, d, generator=gen)
    keys[..., : d // 16] *= 4.0
    keys, vals = keys.to(dtype), torch.randn(bsz, max(total), hkv, d, generator=gen).to(dtype)
    if kind == "reference":
        backend = ReferenceAttentionBackend(pool)
    elif kind == "sdpa-torch":
        backend = _TorchSdpaPrefill(pool)
    else:
        backend = select_backend(pool, device, dtype, hq, kind="kernels", force=force)
    width = max(npg)
    if any(prefixes):  # a reused prefix: its pages exist, its ring rows were never written
        pre = [b for b in range(bsz) if prefixes[b]]
        meta = make_meta([prefixes[b] for b in pre], [prefixes[b] for b in pre], [tables[b] for b in pre],
                         width, PAGE)
        ReferenceAttentionBackend(pool).store(0, torch.cat([keys[b, :prefixes[b]] for b in pre]).to(device),
                                              torch.cat([vals[b, :prefixes[b]] for b in pre]).to(device),
                                              meta.slot_mapping.to(device))
    pool.set_window_start(slots, prefixes)
    cur, scale, res = list(prefixes), d ** -0.5, []
    for qlens in steps:
        meta = make_meta(qlens, [c + n for c, n in zip(cur, qlens)], tables, width, PAGE)
        for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, f, getattr(meta, f).to(device))
        meta.state_slots = torch.tensor(slots, dtype=torch.int32, device=device)
        meta.has_initial_state = torch.tensor([c > 0 for c in cur], device=device)
        q = (torch.randn(sum(qlens), hq, d, generator=gen) * 2.0).to(dtype)
        k = torch.cat([keys[b, cur[b]:cur[b] + n] for b, n in enumerate(qlens)])
        v = torch.cat([vals[b, cur[b]:cur[b] + n] for b, n in enumerate(qlens)])
        backend.plan(meta)
        out = backend.forward(0, q.to(device), k.to(device), v.to(device), meta, scale).double().cpu()
        cpu_pool = type("P", (), {"layers": [{n: t.cpu() for n, t in pool.layers[0].items()}]})
        args = (cpu_pool, fmt, q, keys, vals, qlens, cur, prefixes, tables, meta.is_decode, scale)
        ref, pages_only = _oracle(*args, window=True), _oracle(*args, window=False)
        rel = float((out - ref).norm() / ref.norm()) if bool(torch.isfinite(out).all()) else float("nan")
        res.append((rel, float((pages_only - ref).norm() / ref.norm())))
        cur = [c + n for c, n in zip(cur, qlens)]
    return {"name": name, "steps": res}


class _TorchSdpaPrefill:
    """Prefill steps through ``prefill_sdpa`` with its torch ops and 64-token KV chunks (the window
    overwrite crossing chunk boundaries), decode steps through the reference backend."""

    def __init__(self, pool) -> None:
        from ninfer.attention.reference import ReferenceAttentionBackend
        self.ref = ReferenceAttentionBackend(pool)
        self.plan = self.ref.plan

    def forward(self, layer, q, k, v, meta, scale):
        from ninfer.attention.prefill_sdpa import PrefillWindow, prefill_sdpa
        if meta.is_decode:
            return self.ref.forward(layer, q, k, v, meta, scale)
        ref = self.ref
        ref.store(layer, k, v, meta.slot_mapping)
        ring, slots, starts = ref._ring(layer, meta)
        out = prefill_sdpa(q, ref.pool.layers[layer], ref.fmt, meta.query_lens_cpu, meta.seq_lens_cpu,
                           meta.block_tables, scale, kv_chunk=64, torch_ops=True,
                           window=PrefillWindow(k, v, ring, meta.state_slots, starts))
        t0 = 0
        for b, (n, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            ref.write_ring(ring, slots[b], k[t0:t0 + n], v[t0:t0 + n], sl - n)
            t0 += n
        return out


def _check(r: dict, tol: float) -> None:
    rels, gaps = zip(*r["steps"])  # (a step right after a reused prefix has a 1-token window: a small gap)
    assert max(rels) <= tol, f"relative errors {rels} > {tol} (NaN: an unwritten ring row was read)"
    # power: reading pages instead of the window must break the bound (and stand well clear of the error)
    assert max(gaps) > max(tol, 3 * max(rels)), f"pages-only differs by at most {max(gaps):.3e}: the case has no power"


@pytest.mark.parametrize("case", SCENARIOS, ids=[c[0] for c in SCENARIOS])
def test_reference_window_matches_float64_oracle(case) -> None:
    _check(run_scenario(*case), 1e-5)


@pytest.mark.parametrize("case", SCENARIOS[-2:], ids=[c[0] for c in SCENARIOS[-2:]])
def test_sdpa_prefill_window_matches_float64_oracle(case) -> None:
    _check(run_scenario(*case, kind="sdpa-torch"), 1e-5)


def _tail_case(name, rotated):
    """decode_reduce with a WindowTail and empty page splits (the tail alone) against the torch oracle
    over the ring after the write; the ring row of this step's token holds its k/v."""
    from ninfer.kernels.decode_reduce import decode_reduce
    from ninfer.kernels.window_attn import WindowTail, window_decode_ref
    from ninfer.kvcache.hadamard import rotate
    gen = torch.Generator().manual_seed(11)
    ring = {n: torch.randn(3, 2, W, 128, generator=gen) for n in ("k", "v")}
    q = torch.randn(3, 6, 128, generator=gen)
    k, v = torch.randn(3, 2, 128, generator=gen), torch.randn(3, 2, 128, generator=gen)
    slots, lens = torch.tensor([2, 0, -1], dtype=torch.int32), torch.tensor([300, 5, 0], dtype=torch.int32)
    w = torch.tensor([128, 3, 0], dtype=torch.int32)
    before = {n: t.clone() for n, t in ring.items()}
    out = torch.empty(18, 128)
    decode_reduce(torch.zeros(18, 1, 128), torch.full((18, 1), float("-inf")), out, rotated=rotated,
                  tail=WindowTail(q, k, v, ring, slots, lens, w, 0.1))
    expect = {n: t.clone() for n, t in before.items()}
    for b, s_, n in ((0, 2, 300), (1, 0, 5)):
        expect["k"][s_, :, (n - 1) % W], expect["v"][s_, :, (n - 1) % W] = k[b], v[b]
    o, _ = window_decode_ref(q, expect, slots, lens, w, 0.1)
    o = rotate(rotate(o)) if rotated else o  # the reduce rotates the merged partial back: R R = 1
    return {"name": name, "rel": float((out - o).norm() / o.norm()),
            "ring_ok": all(torch.equal(ring[n], expect[n]) for n in ring), "pad_zero": bool((out[12:] == 0).all())}


TAIL_CASES = [("tail-natural", False), ("tail-rotated", True)]


def _child_case(*case):
    return _tail_case(*case) if case[0].startswith("tail-") else run_scenario(*case)


def _child() -> int:
    force = {"store": "triton", "decode": "triton", "prefill": "sdpa"}
    return child_main([(*c, "kernels", "cpu", torch.float32, force) for c in SCENARIOS if c[0] in CHILD]
                      + TAIL_CASES, _child_case)


results = module_results(__file__)


@pytest.mark.parametrize("name", CHILD)
def test_triton_decode_tail_and_sdpa_prefill_match_oracle(results, name) -> None:
    _check(case_result(results, name), 5e-3)


@pytest.mark.parametrize("name", [c[0] for c in TAIL_CASES])
def test_decode_reduce_tail_writes_the_ring_and_matches_torch(results, name) -> None:
    r = case_result(results, name)
    assert r["ring_ok"] and r["pad_zero"] and r["rel"] < 1e-5, r


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["cuda", "triton"])
@pytest.mark.parametrize("case", SCENARIOS, ids=[c[0] for c in SCENARIOS])
def test_cuda_window_matches_oracle(case, decode) -> None:
    """The engine's CUDA choices (CUDA store, the CUDA or Triton split kernel + the Triton tail, SDPA
    prefill) in bf16. The CUDA split kernel rounds Q to int8 for its 4-bit score MMAs, hence the bound."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if decode == "cuda" and case[3] != 128:
        pytest.skip("the CUDA split kernel serves head_dim 128 / 256")
    _check(run_scenario(*case, kind="kernels", device="cuda", dtype=torch.bfloat16, force={"decode": decode}), 3e-2)


@pytest.mark.cuda
def test_cuda_engine_window_matches_cpu_and_graphs_equal_eager(tiny_checkpoint) -> None:
    """The whole engine on CUDA (CUDA store and decode + window tail, SDPA prefill, decode graphs)
    against the CPU reference engine, teacher-forced; graphs against eager on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.test_gpu_engine import _run
    path = tiny_checkpoint(arch="llama", hidden=128, heads=4, kv_heads=2, head_dim=128)
    ref_toks, ref_logits = _run(path, "cpu", "rk4v4-e8w")
    _, graph = _run(path, "cuda", "rk4v4-e8w", forced=ref_toks)
    _, eager = _run(path, "cuda", "rk4v4-e8w", forced=ref_toks, eager=True)
    for r, g, e in zip(ref_logits, graph, eager):
        assert (g - r).norm() / r.norm() < 3e-2, float((g - r).norm() / r.norm())
        assert torch.allclose(g, e, rtol=0, atol=1e-3), (g - e).abs().max()


def test_window_decode_tail_equals_torch_path() -> None:
    """The tail's torch path (the CPU path and the Triton kernel's oracle) is exact softmax over the
    ring's w newest rows: checked against a direct float64 computation, w = 0 gives lse -inf."""
    from ninfer.kernels.window_attn import window_decode_ref
    gen = torch.Generator().manual_seed(9)
    ring = {n: torch.randn(3, 2, W, 64, generator=gen) for n in ("k", "v")}
    q = torch.randn(3, 4, 64, generator=gen)
    slots = torch.tensor([2, 0, -1], dtype=torch.int32)
    lens = torch.tensor([300, 5, 0], dtype=torch.int32)
    w = torch.tensor([128, 3, 0], dtype=torch.int32)
    o, lse = window_decode_ref(q, ring, slots, lens, w, 0.125)
    for b, (s, n, k) in enumerate([(2, 300, 128), (0, 5, 3)]):
        rows = torch.arange(n - k, n) % W
        kk, vv = ring["k"][s][:, rows].double(), ring["v"][s][:, rows].double()
        sc = torch.einsum("hgd,hjd->hgj", q[b].double().reshape(2, 2, 64), kk) * 0.125
        ref = torch.einsum("hgj,hjd->hgd", torch.softmax(sc, -1), vv).reshape(4, 64)
        torch.testing.assert_close(o[4 * b:4 * b + 4].double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[4 * b:4 * b + 4].double(),
                                   torch.logsumexp(sc, -1).reshape(4) / math.log(2), atol=1e-5, rtol=1e-5)
    assert bool(torch.isinf(lse[8:]).all()) and bool((o[8:] == 0).all())


# ------------------------------------------------------------------ the engine (CPU)
def _llm(path, kv_dtype, **kw):
    from ninfer import LLM
    kw = {"max_context": 512, "kv_capacity": 2048, "max_num_batched_tokens": 64, "max_num_seqs": 4, **kw}
    return LLM(str(path), kv_dtype=kv_dtype, device="cpu", **kw)


@pytest.fixture(scope="module")
def dense(tiny_checkpoint):
    return tiny_checkpoint(arch="qwen3", hidden=64, heads=4, kv_heads=2, head_dim=64)


def _prompts(lens=(150, 100, 180)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 380, (n,), generator=g).tolist() for n in lens]


def test_engine_kl_below_rk4v4_e8_and_plan_counts_the_ring(dense) -> None:
    from ninfer.bench.kl import compare, teacher_forced
    prompts = _prompts()
    tokens, ref = teacher_forced(_llm(dense, "auto"), prompts, 20, None)
    kl = {}
    for fmt in ("rk4v4-e8", "rk4v4-e8w"):
        llm = _llm(dense, fmt)
        kl[fmt] = compare(ref, teacher_forced(llm, prompts, 20, tokens)[1])
    assert kl["rk4v4-e8w"]["mean_kl"] < 0.6 * kl["rk4v4-e8"]["mean_kl"], kl
    assert kl["rk4v4-e8w"]["top1"] >= kl["rk4v4-e8"]["top1"], kl
    eng = llm.engine  # the rk4v4-e8w engine: plan == allocation, 2 layers x 2 heads x 64 x (K, V) x 128 x fp32
    assert eng.plan.window_bytes_per_seq == 2 * 2 * 64 * 2 * W * 4 == eng.plan.state_bytes_per_seq
    assert eng.plan.state_bytes == eng.pool.state_bytes_allocated == 4 * eng.plan.window_bytes_per_seq
    assert "window 262144 B/seq" in eng.plan.capacity_line()
    assert any(line.startswith("window ring: layers=2 slots=4 tokens=128") for line in eng.startup_lines)
    assert "prefix_reuse=1" in eng.startup_lines[-1]


def test_engine_abort_returns_pages_and_window_slots(dense) -> None:
    from ninfer import SamplingParams
    eng = _llm(dense, "rk4v4-e8w").engine
    bm = eng.block_manager
    free = (bm.num_free_pages, bm.num_free_slots)
    assert free[1] == 4
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    long_p, short_p = _prompts((200, 9))
    eng.add_request("short", short_p, params)
    eng.add_request("long", long_p, params)
    eng.step()
    eng.step()
    assert bm.num_free_slots == 2 and 0 < eng.scheduler.requests["long"].num_computed_tokens < len(long_p)
    eng.abort_request("long")     # mid-prefill
    for _ in range(3):
        eng.step()
    eng.abort_request("short")    # mid-decode
    eng.step()
    assert not eng.has_unfinished_requests()
    bm.reset_prefix_cache()
    assert (bm.num_free_pages, bm.num_free_slots) == free


def test_engine_prefix_reuse_reads_reused_tokens_from_pages(dense) -> None:
    """The second request reuses 3 pages of the first one's prompt; before it runs every ring is set
    to NaN, so a read of a ring row it did not write would make its logits NaN. Its logits stay
    close to a run without reuse (which reads those positions from its own ring)."""
    from ninfer.bench.kl import compare, teacher_forced
    base = _prompts((200,))[0]
    second = base[:192] + _prompts((40,))[0]
    fresh_tokens, fresh = teacher_forced(_llm(dense, "rk4v4-e8w", enable_prefix_caching=False), [second], 16, None)
    llm = _llm(dense, "rk4v4-e8w")
    teacher_forced(llm, [base], 4, None)
    for ring in llm.engine.pool.windows:
        for t in ring.values():
            t.fill_(float("nan"))
    tokens, logits = teacher_forced(llm, [second], 16, fresh_tokens)
    assert llm.engine.scheduler.prefix_hits == 192  # the second request reused 3 pages
    assert all(bool(torch.isfinite(x).all()) for x in logits)
    c = compare(fresh, logits)
    _, ref = teacher_forced(_llm(dense, "auto"), [second], 16, fresh_tokens)
    e8 = compare(ref, teacher_forced(_llm(dense, "rk4v4-e8"), [second], 16, fresh_tokens)[1])
    assert c["mean_kl"] < e8["mean_kl"] and c["top1"] >= 0.8, (c, e8)


def test_hybrid_model_with_window_matches_unquantized_below_w(tmp_path_factory) -> None:
    """Qwen3.5 hybrid (GDN + attention): with every sequence shorter than W, the window covers all
    attended tokens, so rk4v4-e8w's greedy tokens equal unquantized KV's."""
    from ninfer import SamplingParams
    from tests.tiny_models import make_hybrid_checkpoint, use_transformers_torch_gdn
    use_transformers_torch_gdn()
    path = make_hybrid_checkpoint(tmp_path_factory.mktemp("hyb-win"), layer_types=("linear", "full"), heads=4,
                                  kv_heads=2, head_dim=128)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = _prompts((70, 9))
    outs = {}
    for fmt in ("auto", "rk4v4-e8w"):
        llm = _llm(path, fmt, dtype="fp32", max_num_batched_tokens=48)
        outs[fmt] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eng = llm.engine
    assert outs["rk4v4-e8w"] == outs["auto"]
    assert any(line.startswith("state pool:") for line in eng.startup_lines)
    assert any(line.startswith("window ring: layers=1") for line in eng.startup_lines)
    assert eng.plan.state_bytes == eng.pool.state_bytes_allocated
    assert eng.plan.window_bytes_per_seq == 2 * 128 * 2 * W * 4 < eng.plan.state_bytes_per_seq
    assert not eng.prefix_caching  # the GDN states still turn prefix reuse off


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_plan_counts_each_ranks_ring(tp: int) -> None:
    """Qwen3-8B geometry: 36 layers x 8/N KV heads x 128 x (K, V) x 128 tokens x bf16 per sequence and
    rank, over max_num_seqs slots; hybrid Qwen3.5 geometry: the ring of its 16 attention layers on top
    of its GDN states."""
    from ninfer.kvcache.planner import GiB, plan_memory
    from ninfer.model_config import ModelConfig
    from tests.test_tp_planner import DENSE, HYBRID
    args = dict(total_bytes=140 * GiB, free_bytes=140 * GiB, max_context=32768, max_num_seqs=8,
                max_num_batched_tokens=2048, device_type="cuda", tensor_parallel_size=tp)
    e8, e8w = (plan_memory(ModelConfig.from_dict(DENSE), kv_dtype=k, **args) for k in ("rk4v4-e8", "rk4v4-e8w"))
    ring = 36 * (8 // tp) * 128 * 2 * W * 2
    assert e8w.window_bytes_per_seq == e8w.state_bytes_per_seq == ring and e8w.state_bytes == 8 * ring
    assert e8.state_bytes == 0 and e8w.bytes_per_token == e8.bytes_per_token
    assert e8w.runtime_bytes - e8w.kv_bytes == e8.runtime_bytes - e8.kv_bytes + 8 * ring
    assert e8w.largest_context < e8.largest_context
    if tp <= 2:
        hyb = plan_memory(ModelConfig.from_dict(HYBRID), kv_dtype="rk4v4-e8w", **args)
        base = plan_memory(ModelConfig.from_dict(HYBRID), kv_dtype="rk4v4-e8", **args)
        assert hyb.window_bytes_per_seq == 16 * (4 // tp) * 256 * 2 * W * 2
        assert hyb.state_bytes_per_seq == base.state_bytes_per_seq + hyb.window_bytes_per_seq


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
