"""The runner's persistent decode inputs (model_runner.DecodeInputs) against a straightforward
construction written here from the requests' lists, over randomized scheduling: arrivals with
shared prefixes (prefix hits), chunked prefill between decode steps, preemption, aborts, requests
finishing mid-batch, decode batches re-drawn as random subsets in random order (the composition
changes every step), a device state scribbled over and forgotten (what the CUDA graphs' copy path
does), a tiny update scratch (several copies per step) and buffers frozen smaller than the batch
(the plain fallback). Everything runs on CPU: the host assembly and the copy + scatter into the
"device" buffers are the same code as on CUDA; only pinning and the events are CUDA-only.
Also: the engine gives the same tokens and logits with the persistent path as with the plain one,
and the detokenizer's direct decoder equals tokenizer.decode."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.detokenizer import make_decoder
from ninfer.engine.model_runner import DecodeInputs, ModelRunner, PreparedInputs, ScheduledBatch
from ninfer.engine.request import Request
from ninfer.engine.scheduler import Scheduler
from ninfer.kvcache.block_manager import BlockManager

PAGE = 4   # small pages: block tables grow every few decode steps
CPU = torch.device("cpu")


def reference(batch: ScheduledBatch, ps: int, width: int) -> dict:
    """The inputs a step must see, built the obvious way, in batch order."""
    ids, pos, slots, slens, sample = [], [], [], [], []
    for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        c = r.num_computed_tokens
        for p in range(c, c + n):
            ids.append(r.token_ids[p])
            pos.append(p)
            slots.append(r.block_table[p // ps] * ps + p % ps)
        slens.append(c + n)
        if c + n == len(r.token_ids):
            sample.append(i)
    tables = torch.full((len(batch.requests), width), -1, dtype=torch.int32)
    for i, r in enumerate(batch.requests):
        tables[i, :len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
    return dict(ids=torch.tensor(ids), pos=torch.tensor(pos), slots=torch.tensor(slots),
                slens=torch.tensor(slens, dtype=torch.int32), tables=tables, sample=sample)


def check_decode(runner: ModelRunner, batch: ScheduledBatch, inp: PreparedInputs) -> bool:
    """Assert `inp` (a decode step) equals the reference; returns whether rows were permuted."""
    b, w = len(batch.requests), runner.max_pages_per_seq
    ref = reference(batch, runner.page_size, w)
    rows = inp.rows if inp.rows is not None else list(range(b))
    assert sorted(rows) == list(range(b)), rows
    at = torch.tensor(rows, dtype=torch.long)
    m = inp.meta
    assert m.is_decode and m.max_query_len == 1 and m.query_lens_cpu == [1] * b
    assert torch.equal(inp.input_ids[at], ref["ids"]) and torch.equal(inp.positions[at], ref["pos"])
    assert torch.equal(m.slot_mapping[at], ref["slots"])
    assert torch.equal(m.seq_lens[at], ref["slens"])
    assert m.seq_lens_cpu == m.seq_lens.tolist() and m.max_seq_len == int(ref["slens"].max())
    assert torch.equal(m.query_start_loc, torch.arange(b + 1, dtype=torch.int32))
    assert m.block_tables.shape == (b, w) and m.block_tables.dtype == torch.int32
    bad = [i for i in range(b) if not torch.equal(m.block_tables[rows[i]], ref["tables"][i])]
    assert not bad, f"stale block-table rows for batch entries {bad}"
    assert inp.sample_req_idx == ref["sample"]
    assert torch.arange(b)[inp.sample_rows].tolist() == [rows[i] for i in ref["sample"]]
    if inp.rows is not None:  # the persistent buffers: rows past the batch are padding for graph buckets
        d = runner.decode_inputs
        assert bool((d.block_tables[b:] == -1).all()), "a row past the batch still holds pages"
        assert bool((d.slot_mapping[b:] == -1).all()) and bool((d.seq_lens[b:] == 0).all())
        assert bool((d.input_ids[b:] == 0).all()) and bool((d.positions[b:] == 0).all())
    return rows != list(range(b))


def check_plain(runner: ModelRunner, batch: ScheduledBatch, inp: PreparedInputs) -> None:
    ref = reference(batch, runner.page_size, max(len(r.block_table) for r in batch.requests))
    assert inp.rows is None and not inp.meta.is_decode
    assert torch.equal(inp.input_ids, ref["ids"]) and torch.equal(inp.meta.slot_mapping, ref["slots"])
    assert torch.equal(inp.meta.block_tables, ref["tables"]) and inp.sample_req_idx == ref["sample"]


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), max_tokens=max_tokens,
                   eos_token_ids=frozenset(), generator=None, detokenizer=None)


def run_scenario(seed: int, steps: int = 400) -> dict:
    rng = random.Random(seed)
    num_pages = rng.choice([24, 40, 64])
    bm = BlockManager(num_pages, PAGE, enable_prefix_caching=rng.random() < 0.8)
    sched = Scheduler(bm, max_num_seqs=rng.choice([3, 5, 8, 12]), max_num_batched_tokens=rng.choice([3, 8, 64, 200]))
    max_ctx = num_pages * PAGE // 3
    width = -(-max_ctx // PAGE)
    runner = ModelRunner(None, None, device=CPU, page_size=PAGE, max_pages_per_seq=width)
    variant = seed % 3
    if variant == 1:   # updates larger than the scratch go in several copies
        runner.decode_inputs = DecodeInputs(CPU, width, PAGE, scratch=rng.choice([1, 3, 7]))
    elif variant == 2:  # frozen at 2 rows (as after graph capture): bigger batches take the plain path
        runner.decode_inputs.reserve(2)
    updates: list[int] = []
    transfer = runner.decode_inputs._transfer
    runner.decode_inputs._transfer = lambda st, k: (updates.append(k), transfer(st, k))[1]
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(PAGE, 6 * PAGE))] for _ in range(3)]
    stats = dict(fast=0, plain_decode=0, prefill=0, permuted=0, aborts=0, finished=0, forgets=0)
    next_id = 0
    with torch.inference_mode():
        for _ in range(steps):
            for _ in range(rng.choice([0, 0, 0, 0, 1, 2])):
                base = rng.choice(prefixes) if rng.random() < 0.6 else []
                prompt = (base + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))])[: max_ctx - 1]
                sched.add(make_request(f"r{next_id}", prompt, rng.randrange(1, max_ctx - len(prompt) + 1)))
                next_id += 1
            if sched.requests and rng.random() < 0.04:
                sched.abort(rng.choice(list(sched.requests)))
                stats["aborts"] += 1
            batch = sched.schedule()
            if not batch.requests:
                continue
            if batch.is_decode and len(batch.requests) > 1 and rng.random() < 0.5:
                # a random subset in random order: still a valid step (the rest just wait a step)
                reqs = rng.sample(batch.requests, rng.randrange(1, len(batch.requests) + 1))
                batch = ScheduledBatch(reqs, [1] * len(reqs))
            inp = runner.prepare(batch)
            if batch.is_decode:
                stats["fast" if inp.rows is not None else "plain_decode"] += 1
                stats["permuted"] += check_decode(runner, batch, inp)
            else:
                stats["prefill"] += 1
                check_plain(runner, batch, inp)
            if rng.random() < 0.03:  # someone else wrote the device buffers (the graphs' copy path)
                d = runner.decode_inputs
                d.buf.random_(-3, 50)
                d.block_tables.random_(-1, num_pages)
                d.forget()
                stats["forgets"] += 1
            sampling = [r for i, r in enumerate(batch.requests) if batch.samples(i)]
            sched.after_step(batch)
            for r in sampling:
                r.append_token(rng.randrange(1000), None)
                if r.num_output_tokens >= r.max_tokens or rng.random() < 0.03:
                    r.finish("stop")
                    sched.finish(r)
                    stats["finished"] += 1
    stats.update(preemptions=sched.num_preemptions, prefix_hits=sched.prefix_hits,
                 chunked=sum(k > runner.decode_inputs.scratch_cap for k in updates),
                 grew=sum(0 < k <= 2 for k in updates), regrown=int(runner.decode_inputs.rows > 8))
    return stats


@pytest.mark.parametrize("seed", range(9))
def test_persistent_decode_inputs_match_reference(seed: int) -> None:
    s = run_scenario(seed)
    print(seed, s)
    assert s["fast"] > 0 and s["fast"] + s["plain_decode"] >= 20 and s["prefill"] > 0


def test_scenarios_cover_the_hard_cases() -> None:
    tot: dict[str, int] = {}
    for seed in range(9):
        for k, v in run_scenario(seed).items():
            tot[k] = tot.get(k, 0) + v
    print(tot)
    for k in ("fast", "plain_decode", "permuted", "aborts", "finished", "forgets", "preemptions", "prefix_hits",
              "chunked", "grew", "regrown"):
        assert tot[k] > 0, f"no scenario exercised {k}: {tot}"


def test_check_catches_a_stale_row() -> None:
    """The check is not vacuous: a table changed behind the runner's back (in place, which the
    BlockManager never does) leaves a stale row that check_decode reports; forget() repairs it."""
    bm = BlockManager(32, PAGE, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    runner = ModelRunner(None, None, device=CPU, page_size=PAGE, max_pages_per_seq=16)
    reqs = [make_request(f"s{i}", list(range(10 + i, 20 + 2 * i)), 30) for i in range(3)]
    for r in reqs:
        sched.add(r)
    with torch.inference_mode():
        for _ in range(6):
            batch = sched.schedule()
            inp = runner.prepare(batch)
            if batch.is_decode:
                check_decode(runner, batch, inp)
            sched.after_step(batch)
            for r in batch.requests:
                r.append_token(7, None)
        victim = reqs[1]
        free_page = next(p for p in range(32) if all(p not in r.block_table for r in reqs))
        victim.block_table[0] = free_page
        batch = sched.schedule()
        assert batch.is_decode
        with pytest.raises(AssertionError, match="stale block-table rows"):
            check_decode(runner, batch, runner.prepare(batch))
        runner.decode_inputs.forget()
        check_decode(runner, batch, runner.prepare(batch))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_readmitted_without_a_decode_step_between(prefix_caching: bool) -> None:
    """A request freed and given new pages (preemption + re-admission, all steps between them
    prefill) comes back to the row it held: the row must be rewritten, not extended."""
    bm = BlockManager(24, PAGE, enable_prefix_caching=prefix_caching)
    runner = ModelRunner(None, None, device=CPU, page_size=PAGE, max_pages_per_seq=12)
    x, a = make_request("x", list(range(100, 113)), 20), make_request("a", list(range(200, 210)), 20)

    def decode_step(reqs: list[Request]) -> None:
        for r in reqs:
            r.num_computed_tokens = r.num_tokens - 1
            bm.append_slot(r)
        batch = ScheduledBatch(reqs, [1] * len(reqs))
        with torch.inference_mode():
            check_decode(runner, batch, runner.prepare(batch))
        for r in reqs:
            bm.mark_computed(r, r.num_tokens)
            r.append_token(3, None)

    for r in (x, a):
        bm.allocate(r)
    for _ in range(5):
        decode_step([x, a])
    old = list(a.block_table)
    bm.free(a)
    filler = make_request("f", list(range(300, 311)), 1)
    bm.allocate(filler)  # takes the pages a just gave back (free list is FIFO)
    bm.allocate(a)
    assert prefix_caching or not set(old) & set(a.block_table)
    decode_step([x, a])
    for _ in range(6):  # and keeps growing correctly afterwards
        decode_step([x, a])


def test_stage_reuse_waits_for_its_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-only branch with fake events: the stages alternate, stage s is written only after
    waiting on the event recorded after its previous copy, and every copy is followed by a record."""
    d = DecodeInputs(CPU, 8, PAGE)
    reqs = [make_request(f"e{i}", list(range(9)), 20) for i in range(2)]
    for i, r in enumerate(reqs):
        r.block_table, r.num_computed_tokens = [3 * i, 3 * i + 1, 3 * i + 2], 8
    log: list[tuple[str, object]] = []

    class FakeEvent:
        def record(self, stream: object) -> None:
            log.append(("record", self))

        def synchronize(self) -> None:
            log.append(("sync", self))

    transfer = d._transfer
    d._transfer = lambda st, k: (log.append(("copy", st)), transfer(st, k))[1]
    with torch.inference_mode():
        for _ in range(2):  # allocates both stages (plain memory here)
            d.prepare(reqs)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        d._cuda = True
        log.clear()
        for _ in range(6):
            d.prepare(reqs)
    stage_of = {id(st): i for i, st in enumerate(d._stages)}
    stage_of.update({id(ev): i for i, ev in enumerate(d._events)})
    got = [(what, stage_of[id(x)]) for what, x in log]
    first = [("copy", 0), ("record", 0), ("copy", 1), ("record", 1)]  # no event yet: nothing to wait for
    assert got == first + [("sync", 0), ("copy", 0), ("record", 0), ("sync", 1), ("copy", 1), ("record", 1)] * 2


def test_engine_same_with_plain_inputs(tiny_model_dir: Path) -> None:
    """Persistent decode inputs vs the plain construction through the whole engine: preemption
    (tight pool), chunked prefill, a prefix hit, an abort and requests finishing mid-batch give
    the same tokens and logits."""
    shared = torch.randint(4, 380, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [shared + [5 + i] * (3 + 9 * i) for i in range(3)] + [[9, 8, 7] * 11]

    def go(plain: bool) -> tuple[dict, dict]:
        llm = LLM(str(tiny_model_dir), kv_dtype="auto", device="cpu", max_context=256, kv_capacity=384,
                  max_num_seqs=4, max_num_batched_tokens=40)
        eng = llm.engine
        if plain:
            eng.runner.prepare = eng.runner.prepare_plain
        logits: dict[str, list[torch.Tensor]] = {}
        eng.logits_hook = lambda reqs, lg: [logits.setdefault(r.request_id, []).append(row.clone())
                                            for r, row in zip(reqs, lg)]
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, SamplingParams(max_tokens=60 + 25 * i, temperature=0.0, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        steps = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id] = out.token_ids
            steps += 1
            if steps == 30:
                eng.abort_request("q2")
        st = eng.stats()
        assert st.num_preemptions > 0 and st.prefix_cache_hits > 0, st
        return tokens, logits

    tok_fast, lg_fast = go(False)
    tok_plain, lg_plain = go(True)
    assert tok_fast == tok_plain
    for rid in lg_plain:
        assert torch.allclose(torch.stack(lg_fast[rid]), torch.stack(lg_plain[rid]), atol=1e-5, rtol=0)


def test_direct_decoder_equals_tokenizer_decode(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rng = random.Random(0)
    for skip in (True, False):
        fast, skipped = make_decoder(tok, skip)
        assert (skipped >= set(tok.all_special_ids)) if skip else not skipped
        assert all(tok.decode([i], skip_special_tokens=True) == "" != tok.decode([i]) for i in skipped)
        for n in (0, 1, 2, 5, 40):
            ids = [rng.randrange(len(tok)) for _ in range(n)]
            assert fast(ids) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    class Custom(type(tok)):  # a class with its own decode must keep going through it
        def decode(self, ids, **kw):
            return "custom"

    tok.__class__ = Custom
    assert make_decoder(tok, True)[0]([1, 2]) == "custom" and make_decoder(tok, True)[1] == frozenset()


@pytest.mark.parametrize("stop", [[], ["wörld"]])
def test_detokenizer_dropping_special_tokens_changes_nothing(tiny_model_dir: Path, stop: list[str]) -> None:
    """Streamed pieces and stop handling with special tokens interleaved (runs of them, inside a
    character split over byte tokens) equal those of the detokenizer that keeps them."""
    from transformers import AutoTokenizer

    from ninfer.engine.detokenizer import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text_ids = tok.encode("héllo wörld 🦊 def main():\n    return 0 the lazy dog 🦊🦊 end")
    specials = sorted(make_decoder(tok, True)[1])
    rng = random.Random(1)
    for trial in range(20):
        ids: list[int] = []
        for t in text_ids:
            ids.append(t)
            if rng.random() < 0.3:
                ids += [rng.choice(specials) for _ in range(rng.randrange(1, 4))]
        streams = []
        for keep in (False, True):
            d = IncrementalDetokenizer(tok, [5, 6, 7], stop=stop)
            if keep:
                d._skipped = frozenset()
            pieces, hit = [], None
            for t in ids:
                hit = d.add_token(t)
                pieces.append(d.take_new_text(finished=hit is not None))
                if hit:
                    break
            if not hit:
                pieces.append(d.take_new_text(finished=True))
            streams.append((pieces, hit, d.text))
        assert streams[0] == streams[1], trial
