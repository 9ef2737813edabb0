"""KV page allocator for the scheduler: free list, reference counts, prefix reuse.

Sequence protocol (what the scheduler's sequence object must provide; see `SequenceLike`):
    seq_id: Hashable            unique while the sequence is live
    token_ids: list[int]        every token so far (prompt + generated), including the newest
                                sampled token whose KV is not yet stored
    block_table: list[int]      page ids, owned and rewritten by the BlockManager
    num_cached_tokens: int      set by `allocate`: leading tokens served from the prefix cache
    state_slot: int             set by `allocate` when the manager has state slots (-1 after `free`)

Public API
----------
`BlockManager(num_pages, page_size=PAGE_SIZE, enable_prefix_caching=True, num_state_slots=0,
slots_allow_prefix=False)`
* `can_allocate(seq) -> bool`, `allocate(seq) -> int` (pages for all of seq.token_ids; returns the
  number of leading tokens whose KV is reused from the prefix cache; the engine computes the rest)
* `may_append(seq) -> bool`, `append_slot(seq) -> None` (grow the table to cover len(token_ids))
* `mark_computed(seq, num_computed_tokens)`: after a step, the pages whose KV is now fully written
  become reusable prefixes (a page is only published once its KV exists, so a chunked prefill of
  one sequence can never hand half-written pages to another)
* `free(seq)`: finish, abort or preempt; cached pages stay findable until reused (LRU); the
  sequence's state slot goes back too
* state slots (models with recurrent layers, ninfer/kvcache/spec.py): `num_state_slots` rows of the
  pool's state tensors; `allocate` gives each sequence one with its pages (and `can_allocate` needs
  one free), `free` takes it back; `num_free_slots`. Prefix reuse is refused with slots (a
  reused page would need the recurrent state at its end, which is not kept) unless
  `slots_allow_prefix`: window rings (rk4v4-e8w) only cache tokens the sequence computed itself.
* `num_pages`, `num_free_pages`, `usage` (fraction of pages held by live sequences),
  `num_cached_pages`, `reset_prefix_cache()`, `check_invariants(live_seqs)`

Rules: only FULL pages are hashed and shared, by a chained hash (blake2b of the parent page's hash
and the page's token ids), confirmed by comparing the token ids. A sequence never reuses the page
holding its last token (it always computes at least one token, so it gets logits), so every page a
sequence writes into is its own: shared pages are full and immutable. Sharing is copy-free.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Protocol

from ninfer.config import PAGE_SIZE


class SequenceLike(Protocol):
    seq_id: Hashable
    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int


def page_hash(parent: bytes, token_ids: Iterable[int]) -> bytes:
    """Chained hash of one full page: depends on every token before it through `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class _Page:
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, slots_allow_prefix: bool = False) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        if num_state_slots < 0 or (num_state_slots and enable_prefix_caching and not slots_allow_prefix):
            raise ValueError(f"num_state_slots={num_state_slots}: must be >= 0, and prefix caching must be off "
                             "with recurrent state slots")
        self.num_state_slots = num_state_slots
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self._slot_of: dict[Hashable, int] = {}
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pages = [_Page() for _ in range(num_pages)]
        self._free: deque[int] = deque(range(num_pages))        # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; oldest first
        self._by_hash: dict[bytes, int] = {}
        # Chained hashes of a sequence's leading full pages, computed lazily and kept while it is
        # live (_chains) or, for the last sequence probed while waiting, in _probe (held by object
        # identity, so a reused seq_id can never see another sequence's hashes).
        self._chains: dict[Hashable, list[bytes]] = {}
        self._published: dict[Hashable, int] = {}                # seq_id -> leading pages already offered
        self._probe: tuple[SequenceLike, list[bytes]] | None = None

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages with a published hash (live or evictable)."""
        return len(self._by_hash)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix lookup ----------------------------------------------------------------------
    def _chain(self, seq: SequenceLike) -> list[bytes]:
        chain = self._chains.get(seq.seq_id)
        if chain is None:
            if self._probe is None or self._probe[0] is not seq:
                self._probe = (seq, [])
            chain = self._probe[1]
        return chain

    def _page_hash(self, seq: SequenceLike, chain: list[bytes], i: int) -> bytes:
        """Hash of seq's full page i (pages before it must be full too); tokens are append-only."""
        ps = self.page_size
        while len(chain) <= i:
            j = len(chain)
            chain.append(page_hash(chain[-1] if chain else b"", seq.token_ids[j * ps:(j + 1) * ps]))
        return chain[i]

    def _lookup(self, seq: SequenceLike) -> list[int]:
        """Pages of seq's longest cached prefix (full pages, each confirmed by its token ids)."""
        if not self.enable_prefix_caching:
            return []
        tokens, ps = seq.token_ids, self.page_size
        chain = self._chain(seq)
        hits: list[int] = []
        # Never the page holding the last token: at least one token must be computed.
        for i in range((len(tokens) - 1) // ps):
            pid = self._by_hash.get(self._page_hash(seq, chain, i))
            if pid is None or self._pages[pid].token_ids != tuple(tokens[i * ps:(i + 1) * ps]):
                break
            hits.append(pid)
        return hits

    def can_allocate(self, seq: SequenceLike) -> bool:
        if self.num_state_slots and not self._free_slots:
            return False
        hits = self._lookup(seq)
        # A hit on an evictable page takes it out of the free count too.
        hits_free = sum(1 for p in hits if self._pages[p].ref_count == 0)
        return self.num_free_pages - hits_free >= self.pages_needed(len(seq.token_ids)) - len(hits)

    # ---- allocation -------------------------------------------------------------------------
    def _take_free_page(self) -> int:
        if self._free:
            pid = self._free.popleft()
        elif self._evictable:
            pid, _ = self._evictable.popitem(last=False)  # least recently freed cached page
            page = self._pages[pid]
            if self._by_hash.get(page.hash) == pid:
                del self._by_hash[page.hash]
            page.hash, page.token_ids = None, ()
        else:
            raise RuntimeError("KV pool exhausted: no free page (call can_allocate/may_append first)")
        self._pages[pid].ref_count = 1
        return pid

    def allocate(self, seq: SequenceLike) -> int:
        """Give seq pages for all its tokens; returns the number of leading tokens already cached."""
        if seq.block_table or seq.seq_id in self._chains:
            raise ValueError(f"sequence {seq.seq_id!r} already has pages (seq_id must be unique among live ones)")
        if not seq.token_ids:
            raise ValueError(f"sequence {seq.seq_id!r} has no tokens")
        if not self.can_allocate(seq):
            raise RuntimeError(f"not enough free KV pages for sequence {seq.seq_id!r} "
                               f"({self.pages_needed(len(seq.token_ids))} needed, {self.num_free_pages} free)")
        hits = self._lookup(seq)
        table: list[int] = []
        for pid in hits:
            page = self._pages[pid]
            if page.ref_count == 0:
                del self._evictable[pid]
            page.ref_count += 1
            table.append(pid)
        for _ in range(self.pages_needed(len(seq.token_ids)) - len(hits)):
            table.append(self._take_free_page())
        seq.block_table = table
        seq.num_cached_tokens = len(hits) * self.page_size
        if self.num_state_slots:
            seq.state_slot = self._slot_of[seq.seq_id] = self._free_slots.popleft()
        self._chains[seq.seq_id] = self._chain(seq)
        self._published[seq.seq_id] = len(hits)
        self._probe = None
        return seq.num_cached_tokens

    def may_append(self, seq: SequenceLike) -> bool:
        return self.num_free_pages >= self.pages_needed(len(seq.token_ids)) - len(seq.block_table)

    def append_slot(self, seq: SequenceLike) -> None:
        """Grow seq's table so it covers every token in seq.token_ids (a new page when one fills)."""
        missing = self.pages_needed(len(seq.token_ids)) - len(seq.block_table)
        if missing > self.num_free_pages:
            raise RuntimeError(f"KV pool exhausted appending to sequence {seq.seq_id!r} (preempt first)")
        for _ in range(missing):
            seq.block_table.append(self._take_free_page())

    def mark_computed(self, seq: SequenceLike, num_computed_tokens: int) -> None:
        """Publish seq's full pages whose KV has been written (the first num_computed_tokens)."""
        if not self.enable_prefix_caching or seq.seq_id not in self._chains:
            return  # not live (e.g. a late call after free): nothing to publish, no state to keep
        chain, ps = self._chains[seq.seq_id], self.page_size
        full = min(min(num_computed_tokens, len(seq.token_ids)) // ps, len(seq.block_table))
        for i in range(self._published[seq.seq_id], full):
            h = self._page_hash(seq, chain, i)
            page = self._pages[seq.block_table[i]]
            # Another page with the same content may already be published (two sequences computed
            # the same prefix at once): keep the first, this one stays private and unhashed.
            if page.hash is None and h not in self._by_hash:
                page.hash, page.token_ids = h, tuple(seq.token_ids[i * ps:(i + 1) * ps])
                self._by_hash[h] = seq.block_table[i]
        self._published[seq.seq_id] = max(full, self._published[seq.seq_id])

    def free(self, seq: SequenceLike) -> None:
        """Release seq's pages (finish, abort, preempt). Tail pages are released first so that the
        LRU evicts a prefix's tail before its head, keeping the most shareable pages longest."""
        for pid in reversed(seq.block_table):
            page = self._pages[pid]
            if page.ref_count <= 0:
                raise RuntimeError(f"page {pid} freed more often than allocated (sequence {seq.seq_id!r})")
            page.ref_count -= 1
            if page.ref_count == 0:
                if page.hash is not None:
                    self._evictable[pid] = None
                else:
                    self._free.append(pid)
        seq.block_table = []
        seq.num_cached_tokens = 0
        slot = self._slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            seq.state_slot = -1
        self._chains.pop(seq.seq_id, None)
        self._published.pop(seq.seq_id, None)
        if self._probe is not None and self._probe[0] is seq:
            self._probe = None

    def reset_prefix_cache(self) -> None:
        """Forget every published prefix (live pages stay allocated, just unshareable)."""
        for pid in list(self._evictable):
            self._free.append(pid)
        self._evictable.clear()
        for page in self._pages:
            page.hash, page.token_ids = None, ()
        self._by_hash.clear()

    def check_invariants(self, live_seqs: Iterable[SequenceLike]) -> None:
        """Raise RuntimeError if the accounting disagrees with `live_seqs` (tests, debugging)."""
        live = list(live_seqs)
        refs = [0] * self.num_pages
        for s in live:
            if len(s.block_table) < self.pages_needed(len(s.token_ids)):
                raise RuntimeError(f"sequence {s.seq_id!r} has too few pages for its tokens")
            for pid in s.block_table:
                refs[pid] += 1
        for pid, page in enumerate(self._pages):
            if page.ref_count != refs[pid]:
                raise RuntimeError(f"page {pid}: ref_count {page.ref_count} but {refs[pid]} holders")
            if page.ref_count > 1 and (page.hash is None or len(page.token_ids) != self.page_size):
                raise RuntimeError(f"page {pid} is shared by {page.ref_count} sequences but not full and published")
        free, evict = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evict:
            raise RuntimeError("a page is listed twice in the free lists")
        zero = {pid for pid, r in enumerate(refs) if r == 0}
        if zero != free | evict:
            raise RuntimeError(f"leaked pages {sorted(zero - free - evict)} / live pages in free lists "
                               f"{sorted((free | evict) - zero)}")
        for h, pid in self._by_hash.items():
            if self._pages[pid].hash != h:
                raise RuntimeError(f"hash index points at page {pid} with another hash")
        if any(self._pages[pid].hash is None for pid in evict) or any(self._pages[pid].hash for pid in free):
            raise RuntimeError("free/evictable lists disagree with page hashes")
        slots = [self._slot_of.get(s.seq_id) for s in live] if self.num_state_slots else []
        free_slots = set(self._free_slots)
        if slots and (None in slots or len(set(slots)) != len(slots) or set(slots) & free_slots
                      or len(slots) + len(free_slots) != self.num_state_slots
                      or any(getattr(s, "state_slot", None) != x for s, x in zip(live, slots))):
            raise RuntimeError(f"state slots disagree: live {slots}, free {sorted(self._free_slots)} "
                               f"of {self.num_state_slots}")
        # A page another sequence writes into (its tail page, not full) must be private to it.
        for s in live:
            n = len(s.token_ids)
            if n % self.page_size and s.block_table:
                tail = s.block_table[self.pages_needed(n) - 1]
                if refs[tail] != 1:
                    raise RuntimeError(f"sequence {s.seq_id!r} writes into shared page {tail}")
