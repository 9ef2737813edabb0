"""Recurrent-state seams (ninfer/kvcache/spec.py) with a fake recurrent layer, no real model:
slot allocation and release on finish / abort / preemption, the metadata a recurrent layer sees
(state_slots, has_initial_state) on the plain and the persistent decode path, and a state that
is carried correctly across prefill chunks, decode steps and preemption.

The fake model's recurrent layer keeps, per sequence, the sum and the count of every token id it
has consumed (float64 state, so sums are exact): after any schedule its state must equal the sum
and count of exactly the tokens computed so far. A slot that was not reset at (re)admission, a
wrong slot, or a has_initial_state that lets a sequence continue a stale state all break that
equality; its output row (the running sum) feeds the next token, so a wrong state also changes
the generated tokens, which are compared with the arithmetic."""
from __future__ import annotations

import random

import pytest
import torch

from ninfer.attention.reference import ReferenceAttentionBackend
from ninfer.engine.model_runner import ModelRunner
from ninfer.engine.scheduler import Scheduler
from ninfer.kvcache.block_manager import BlockManager
from ninfer.kvcache.formats import get_format
from ninfer.kvcache.pool import KVCachePool
from ninfer.kvcache.spec import AttentionSpec, CacheSpec, RecurrentStateSpec
from tests.test_scheduler import make_request

PAGE, VOCAB, HKV, D = 64, 97, 1, 64
STATE = RecurrentStateSpec({"sum": (1,), "count": (1,)}, torch.float64)
SPEC = CacheSpec((AttentionSpec(HKV, D, get_format("bf16")), STATE))


class FakeHybrid(torch.nn.Module):
    """Layer 0: attention through the backend (stores K/V, as a real layer would); layer 1: a
    recurrent layer whose state is the running (sum, count) of its sequence's token ids."""

    def forward(self, input_ids, positions, meta, backend):
        t = input_ids.shape[0]
        x = input_ids.to(torch.float32)[:, None, None].expand(t, HKV, D).contiguous() / VOCAB
        backend.forward(0, x, x, x, meta, D ** -0.5)
        st = backend.state(0)
        out = torch.empty(t, dtype=torch.float64)
        starts = meta.query_start_loc.tolist()
        for b, slot in enumerate(meta.state_slots.tolist()):
            ids = input_ids[starts[b]:starts[b + 1]].to(torch.float64)
            if not len(ids):
                continue
            s0 = st["sum"][slot, 0] if bool(meta.has_initial_state[b]) else torch.zeros((), dtype=torch.float64)
            c0 = st["count"][slot, 0] if bool(meta.has_initial_state[b]) else torch.zeros((), dtype=torch.float64)
            run = s0 + torch.cumsum(ids, 0)
            out[starts[b]:starts[b + 1]] = run
            st["sum"][slot, 0] = run[-1]
            st["count"][slot, 0] = c0 + len(ids)
        return out

    def compute_logits(self, hidden):  # next token = running sum mod VOCAB
        return torch.nn.functional.one_hot(hidden.to(torch.int64) % VOCAB, VOCAB).to(torch.float32)


def _engine_parts(num_pages: int, max_seqs: int, budget: int):
    pool = KVCachePool.from_spec(SPEC, num_pages, max_seqs, "cpu", torch.float32)
    bm = BlockManager(num_pages, PAGE, enable_prefix_caching=False, num_state_slots=max_seqs)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    runner = ModelRunner(FakeHybrid(), ReferenceAttentionBackend(pool), device=torch.device("cpu"),
                         page_size=PAGE, max_pages_per_seq=num_pages)
    return pool, bm, sched, runner


def _expected_tokens(prompt: list[int], n: int) -> list[int]:
    toks, s = list(prompt), sum(prompt)
    for _ in range(n):
        toks.append(s % VOCAB)
        s += toks[-1]
    return toks[len(prompt):]


def _check_states(pool: KVCachePool, running) -> None:
    for r in running:
        got = (float(pool.states[0]["sum"][r.state_slot, 0]), float(pool.states[0]["count"][r.state_slot, 0]))
        c = r.num_computed_tokens
        assert got == (float(sum(r.token_ids[:c])), float(c)), f"{r.request_id}: state {got} after {c} tokens"


@pytest.mark.parametrize("seed", range(4))
def test_state_follows_chunks_decode_preemption_and_abort(seed: int) -> None:
    rng = random.Random(seed)
    pool, bm, sched, runner = _engine_parts(num_pages=4, max_seqs=3, budget=rng.choice([24, 40, 100]))
    reqs = {}
    for i in range(6):  # three running requests need more than the 256 slots of the pool: preemption
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 90))]
        reqs[f"r{i}"] = make_request(f"r{i}", prompt, rng.randrange(40, 80))
        sched.add(reqs[f"r{i}"])
    aborted, preempted = set(), 0
    for step in range(500):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        bm.check_invariants(sched.running)
        assert sorted(r.state_slot for r in sched.running) == sorted({r.state_slot for r in sched.running})
        assert all(getattr(r, "state_slot", -1) == -1 for r in sched.waiting)
        idx, logits = runner.execute(batch)
        sched.after_step(batch)
        _check_states(pool, batch.requests)
        for j, i in enumerate(idx):           # logits row j is batch entry idx[j]
            r = batch.requests[i]
            r.append_token(int(logits[j].argmax()), None)
            if r.num_output_tokens >= r.max_tokens:
                r.finish("length")
                sched.finish(r)
        if step == 5 and sched.running:
            victim = sched.running[0]
            sched.abort(victim.request_id)
            aborted.add(victim.request_id)
            assert victim.state_slot == -1
        preempted = sched.num_preemptions
    assert not sched.has_unfinished() and bm.num_free_slots == 3
    assert preempted > 0, "this schedule never preempted"
    for rid, r in reqs.items():
        if rid not in aborted:
            assert r.output_token_ids == _expected_tokens(r.prompt_token_ids, r.max_tokens), rid


def test_decode_path_carries_slots_like_the_plain_path() -> None:
    pool, bm, sched, runner = _engine_parts(num_pages=8, max_seqs=4, budget=512)
    rs = [make_request(f"r{i}", [i + 1] * (i + 2), 8) for i in range(3)]
    for r in rs:
        sched.add(r)
    batch = sched.schedule()
    runner.execute(batch)
    sched.after_step(batch)
    for r in rs:
        r.append_token(1, None)
    one = make_request("fresh", [5], 4)  # a 1-token prompt: a decode-shaped step without initial state
    sched.add(one)
    batch = sched.schedule()
    assert batch.is_decode and len(batch.requests) == 4
    plain = runner.prepare_plain(batch).meta
    dec = runner.prepare(batch)
    rows = dec.rows if dec.rows is not None else list(range(4))
    for i, r in enumerate(batch.requests):
        assert int(dec.meta.state_slots[rows[i]]) == int(plain.state_slots[i]) == r.state_slot
        assert bool(dec.meta.has_initial_state[rows[i]]) == bool(plain.has_initial_state[i]) == (r is not one)


def test_block_manager_slots() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(4, PAGE, enable_prefix_caching=True, num_state_slots=2)
    bm = BlockManager(8, PAGE, enable_prefix_caching=False, num_state_slots=2)
    a, b, c = (make_request(n, [1, 2, 3], 4) for n in "abc")
    bm.allocate(a)
    bm.allocate(b)
    assert {a.state_slot, b.state_slot} == {0, 1} and bm.num_free_slots == 0
    assert not bm.can_allocate(c)  # pages are free, slots are not
    bm.free(a)
    assert a.state_slot == -1 and bm.can_allocate(c)
    bm.allocate(c)
    bm.check_invariants([b, c])
    b.state_slot = c.state_slot  # two live sequences on one slot
    with pytest.raises(RuntimeError, match="state slots disagree"):
        bm.check_invariants([b, c])


def test_pool_and_plan_derive_from_the_spec() -> None:
    from ninfer.kvcache.planner import StatesDoNotFit, plan_memory
    from ninfer.model_config import ModelConfig

    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256,
                                     hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=HKV, head_dim=D,
                                     max_position_embeddings=4096))
    big = RecurrentStateSpec({"h": (16, 128, 128), "conv": (3, 128)}, {"h": torch.float32, "conv": torch.bfloat16})
    assert big.bytes_per_seq() == 16 * 128 * 128 * 4 + 3 * 128 * 2
    spec = CacheSpec((AttentionSpec(HKV, D, get_format("int8")), big))
    kw = dict(kv_dtype="int8", total_bytes=1 << 30, max_context=1024, max_num_batched_tokens=256,
              device_type="cpu", cache_spec=spec, headroom_bytes=0)
    free = 64 << 20
    plan = plan_memory(cfg, free_bytes=free, max_num_seqs=8, **kw)
    assert plan.state_bytes_per_seq == big.bytes_per_seq() and plan.state_bytes == 8 * big.bytes_per_seq()
    assert plan.bytes_per_token == get_format("int8").bytes_per_token_head(D) * HKV  # one attention layer
    assert plan.runtime_bytes == (plan.kv_bytes + plan.state_bytes + plan.page_table_bytes + plan.workspace_bytes
                                  + plan.graph_bytes)
    assert f"states={plan.state_bytes / (1 << 20):.2f} MiB ({big.bytes_per_seq()} B/seq x 8 slots)" in \
        plan.capacity_line() and plan.terms()["states"] == plan.state_bytes
    pool = KVCachePool.from_plan(plan, "cpu", torch.bfloat16, spec=spec)
    pool.assert_geometry()
    assert pool.state_bytes_allocated == plan.state_bytes and pool.bytes_allocated == plan.kv_bytes
    assert pool.states[0]["h"].shape == (8, 16, 128, 128) and pool.states[0]["conv"].dtype == torch.bfloat16
    assert "state pool: layers=1 slots=8" in pool.geometry_lines()[-1]
    with pytest.raises(ValueError, match="pass its CacheSpec"):
        KVCachePool.from_plan(plan, "cpu", torch.bfloat16)
    # max_num_seqs whose states alone exceed what is left: refused with the numbers
    n = 80  # 80 MiB of states on a 64 MiB device
    with pytest.raises(StatesDoNotFit) as e:
        plan_memory(cfg, free_bytes=free, max_num_seqs=n, **kw)
    fit = e.value.max_num_seqs_fit
    assert 0 < fit < n and f"max_num_seqs={n} does not fit" in str(e.value)
    assert f"at most {fit} sequences" in str(e.value)
    assert f"{big.bytes_per_seq()} B/seq x {n} slots" in str(e.value)
    plan_memory(cfg, free_bytes=free, max_num_seqs=fit, **kw)  # the number it names does fit
    # the dense default is unchanged: no state term anywhere
    dense = plan_memory(cfg, free_bytes=free, max_num_seqs=8, **{**kw, "cache_spec": None})
    assert dense.state_bytes == 0 and "states" not in dense.terms() and "states=" not in dense.capacity_line()
