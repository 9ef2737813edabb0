"""Block manager: prefix reuse of full pages, LRU eviction, and a randomized scheduler simulation
in which simulated KV content proves that reused pages hold exactly what the sequence would have
computed, that nobody writes into a page someone else reads, and that no page leaks."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from ninfer.kvcache.block_manager import BlockManager

PS = 64


@dataclass
class Seq:
    seq_id: int
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed: int = 0


def test_prefix_hit_shares_full_pages_only():
    bm = BlockManager(16)
    a = Seq(1, list(range(200)))
    assert bm.allocate(a) == 0 and len(a.block_table) == 4
    # Nothing is published before its KV exists.
    b = Seq(2, list(range(150)) + [9999])
    assert bm.allocate(b) == 0
    bm.free(b)
    bm.mark_computed(a, 200)
    assert bm.num_cached_pages == 3          # the 4th page (tokens 192..199) is partial
    b = Seq(3, list(range(150)) + [9999])
    assert bm.allocate(b) == 128
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    bm.check_invariants([a, b])
    assert bm.num_free_pages == 16 - 4 - 1


def test_never_reuses_the_page_of_the_last_token():
    bm = BlockManager(8)
    a = Seq(1, list(range(128)))
    bm.allocate(a)
    bm.mark_computed(a, 128)
    b = Seq(2, list(range(128)))
    assert bm.allocate(b) == 64               # the page holding token 127 is recomputed
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    c = Seq(3, list(range(129)))
    assert bm.allocate(c) == 128
    bm.check_invariants([a, b, c])


def test_chained_hash_depends_on_the_whole_prefix():
    bm = BlockManager(8)
    a = Seq(1, [1] * 64 + [2] * 64 + [3])
    bm.allocate(a)
    bm.mark_computed(a, 129)
    b = Seq(2, [7] * 64 + [2] * 64 + [3])     # same second page, different first page
    assert bm.allocate(b) == 0


def test_freed_cached_pages_are_reused_lru():
    bm = BlockManager(4)
    a = Seq(1, list(range(129)))
    bm.allocate(a)
    head = a.block_table[0]
    bm.mark_computed(a, 129)
    bm.free(a)
    assert bm.num_free_pages == 4 and bm.num_cached_pages == 2 and bm.usage == 0.0
    b = Seq(2, list(range(129)) + [5])
    assert bm.can_allocate(b) and bm.allocate(b) == 128
    bm.free(b)
    # Filling the pool evicts cached pages: the plain free pages go first, then the least recently
    # freed cached page (the tail page 1 was freed before the head page 0).
    c = Seq(3, [77] * (3 * 64))
    bm.allocate(c)
    assert bm.num_cached_pages == 1 and head not in c.block_table and bm.usage == 0.75
    bm.check_invariants([c])
    bm.free(c)
    d = Seq(4, list(range(65)))
    assert bm.allocate(d) == 64 and d.block_table[0] == head
    bm.check_invariants([d])


def test_can_allocate_counts_hits_on_evictable_pages():
    bm = BlockManager(3)
    a = Seq(1, list(range(129)))
    bm.allocate(a)
    bm.mark_computed(a, 129)
    bm.free(a)
    assert bm.can_allocate(Seq(2, list(range(129)) + [1]))        # 2 hits + 1 new page = 3
    assert not bm.can_allocate(Seq(3, list(range(129)) + [1] * 64))  # 2 hits + 2 new pages


def test_no_prefix_caching():
    bm = BlockManager(8, enable_prefix_caching=False)
    a = Seq(1, list(range(129)))
    bm.allocate(a)
    bm.mark_computed(a, 129)
    assert bm.allocate(Seq(2, list(range(129)))) == 0 and bm.num_cached_pages == 0


def test_errors():
    bm = BlockManager(2)
    with pytest.raises(ValueError):
        BlockManager(0)
    with pytest.raises(ValueError, match="no tokens"):
        bm.allocate(Seq(1, []))
    a = Seq(1, list(range(100)))
    bm.allocate(a)
    with pytest.raises(ValueError, match="already has pages"):
        bm.allocate(a)
    with pytest.raises(RuntimeError, match="not enough free"):
        bm.allocate(Seq(2, list(range(100))))
    a.token_ids += list(range(100))
    assert not bm.may_append(a)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.append_slot(a)


def test_reused_seq_id_never_sees_another_sequences_hashes():
    bm = BlockManager(16)
    x, y = [1] * 64 + [2] * 64, [3] * 64 + [2] * 64
    a = Seq(0, x + [9])
    bm.allocate(a)
    bm.mark_computed(a, 129)
    probe = Seq(1, x + [5])
    assert bm.can_allocate(probe)               # hashes of x are now cached for this probe...
    b = Seq(1, y + [5])                          # ...but another request reuses the id
    assert bm.allocate(b) == 0
    bm.mark_computed(b, 129)
    c, d = Seq(2, y + [7]), Seq(3, x + [7])
    assert bm.allocate(c) == 128 and c.block_table[:2] == b.block_table[:2]
    assert bm.allocate(d) == 128 and d.block_table[:2] == a.block_table[:2]
    with pytest.raises(ValueError, match="unique"):
        bm.allocate(Seq(1, [4] * 10))
    bm.check_invariants([a, b, c, d])


def test_check_invariants_catches_leaks_and_freed_chains():
    bm = BlockManager(4)
    a = Seq(1, list(range(70)))
    bm.allocate(a)
    with pytest.raises(RuntimeError, match="ref_count"):
        bm.check_invariants([])                # a's pages are held by nobody we know of
    bm.free(a)
    bm.mark_computed(a, 70)                    # late call after free: no effect, no leftover state
    assert not bm._chains
    bm.check_invariants([])


# ---- randomized simulation ---------------------------------------------------------------------
def kv_of(tokens: list[int], pos: int) -> int:
    """Simulated KV of position pos: depends on every token up to it (as real attention KV does)."""
    return hash(tuple(tokens[:pos + 1]))


class Sim:
    def __init__(self, seed: int, num_pages: int, caching: bool) -> None:
        self.rng = random.Random(seed)
        self.bm = BlockManager(num_pages, PS, enable_prefix_caching=caching)
        self.kv: dict[tuple[int, int], int] = {}         # (page, offset) -> simulated KV
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.next_id = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(n)] for n in (64, 130, 200, 256)]
        self.hits = 0
        self.preempts = 0

    def new_seq(self) -> Seq:
        r = self.rng
        base = r.choice(self.prefixes)[: r.randrange(1, 257)] if r.random() < 0.8 else []
        toks = base + [r.randrange(50) for _ in range(r.randrange(1 if base else 1, 100))]
        self.next_id += 1
        return Seq(self.next_id, toks)

    def holders(self) -> dict[int, list[Seq]]:
        out: dict[int, list[Seq]] = {}
        for s in self.running:
            for p in s.block_table:
                out.setdefault(p, []).append(s)
        return out

    def admit(self) -> None:
        s = self.waiting[0] if self.waiting and self.rng.random() < 0.7 else self.new_seq()
        if not self.bm.can_allocate(s):
            if s not in self.waiting:
                self.waiting.append(s)
            return
        if s in self.waiting:
            self.waiting.remove(s)
        cached = self.bm.allocate(s)
        assert cached % PS == 0 and cached < len(s.token_ids)
        self.hits += cached > 0
        # Reused pages must hold exactly the KV this sequence would have computed.
        for pos in range(cached):
            assert self.kv[(s.block_table[pos // PS], pos % PS)] == kv_of(s.token_ids, pos)
        s.num_computed = cached
        self.running.append(s)

    def compute(self, s: Seq, n: int) -> None:
        """One chunk: write KV for the next n tokens (never into a page another sequence holds)."""
        holders = self.holders()
        end = min(len(s.token_ids), s.num_computed + n)
        for pos in range(s.num_computed, end):
            page = s.block_table[pos // PS]
            assert holders[page] == [s], f"seq {s.seq_id} writes into page {page} shared with others"
            self.kv[(page, pos % PS)] = kv_of(s.token_ids, pos)
        s.num_computed = end
        self.bm.mark_computed(s, end)

    def step(self) -> None:
        r, op = self.rng, self.rng.random()
        if op < 0.2:
            self.admit()
        elif self.running:
            s = r.choice(self.running)
            if s.num_computed < len(s.token_ids):
                self.compute(s, r.choice([1, 17, 64, 100, 1000]))       # chunked prefill
            elif op < 0.95:
                s.token_ids.append(r.randrange(50))                      # decode one token
                if not self.bm.may_append(s):
                    victim = r.choice(self.running)                      # preempt (recompute later)
                    self.preempts += 1
                    self.bm.free(victim)
                    self.running.remove(victim)
                    victim.num_computed = 0
                    self.waiting.insert(0, victim)
                    if victim is s:
                        return
                    if not self.bm.may_append(s):
                        s.token_ids.pop()
                        return
                self.bm.append_slot(s)
                self.compute(s, 1)
            else:                                                        # finish or abort
                self.bm.free(s)
                self.running.remove(s)
        self.bm.check_invariants(self.running)
        # Independent check: refcounts equal holders, shared pages are full and identical prefixes.
        for page, hs in self.holders().items():
            if len(hs) > 1:
                for h in hs:
                    i = h.block_table.index(page)
                    assert (i + 1) * PS <= h.num_computed, "a shared page is still being written"
                    assert h.token_ids[: (i + 1) * PS] == hs[0].token_ids[: (i + 1) * PS]
        assert self.bm.num_free_pages == self.bm.num_pages - len(self.holders())


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("caching", [True, False])
def test_randomized_no_leaks_no_shared_writes(seed, caching):
    sim = Sim(seed, num_pages=16 + seed * 4, caching=caching)
    for _ in range(1000):
        sim.step()
    assert sim.preempts > 0
    for s in list(sim.running):
        sim.bm.free(s)
    sim.running.clear()
    sim.bm.check_invariants([])
    assert sim.bm.num_free_pages == sim.bm.num_pages and sim.bm.usage == 0.0
    if caching:
        assert sim.hits > 0                     # shared prefixes were actually reused
    else:
        assert sim.hits == 0 and sim.bm.num_cached_pages == 0
