"""The scheduled step as the driver sends it to the other ranks, and its replay on them.

Followers run the same `ModelRunner.execute` as the driver, on stand-ins of the driver's requests
(`Mirror`): only what the runner reads (token ids, computed count, page table, state slot). The
message carries deltas, not the requests: per scheduled request its key, computed count, new-token
count, the token ids appended since it was last sent, and its page table as either the entries
appended since last time or a whole new table. The BlockManager rebinds `block_table` on
allocate/free (preemption, re-admission) and only appends otherwise, so comparing the list object
with the one last sent tells which. A request is sent whole the first time and dropped on the
followers once it finished (abort included): the next message lists its key.

A follower's mirror keeps the same identity across steps and rebinds its table exactly when the
driver's does, so the runner's persistent decode rows (DecodeInputs) update incrementally on every
rank alike, and every rank writes the same pages."""
from __future__ import annotations

import itertools
from typing import Any

from ninfer.engine.model_runner import ScheduledBatch

# entry: (key, num_computed_tokens, num_new_tokens, new token ids, table kind, table ids, state slot)
TABLE_SAME, TABLE_APPEND, TABLE_NEW = 0, 1, 2


class StepEncoder:
    """Driver side: what each follower already knows of each request."""

    def __init__(self) -> None:
        self._keys = itertools.count()
        # request -> [key, tokens sent, the block_table list last sent, entries of it sent]
        self._known: dict[Any, list] = {}

    def encode(self, batch: ScheduledBatch) -> tuple[list[int], list[tuple]]:
        """(keys to drop, entries) for `batch`; call once per step, in step order."""
        drop = [st[0] for r, st in self._known.items() if r.is_finished]
        if drop:
            self._known = {r: st for r, st in self._known.items() if not r.is_finished}
        entries = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            st = self._known.get(req)
            if st is None:
                st = self._known[req] = [next(self._keys), 0, None, 0]
            toks = req.token_ids
            new_toks = toks[st[1]:] if len(toks) > st[1] else []
            bt = req.block_table
            if bt is st[2]:
                kind, ids = (TABLE_APPEND, bt[st[3]:]) if len(bt) > st[3] else (TABLE_SAME, [])
            else:
                kind, ids = TABLE_NEW, list(bt)
            st[1], st[2], st[3] = len(toks), bt, len(bt)
            entries.append((st[0], req.num_computed_tokens, n, new_toks, kind, ids, getattr(req, "state_slot", -1)))
        return drop, entries

    def forget(self) -> None:
        """Followers start over (a fresh group): every request is sent whole again."""
        self._known.clear()


class Mirror:
    """A follower's stand-in for one of the driver's requests: what the model runner reads."""
    __slots__ = ("request_id", "token_ids", "num_computed_tokens", "block_table", "state_slot")

    def __init__(self, key: int) -> None:
        self.request_id = f"#{key}"
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.state_slot = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class StepDecoder:
    """Follower side: the mirrors, and the batch of each message."""

    def __init__(self) -> None:
        self.mirrors: dict[int, Mirror] = {}

    def decode(self, msg: tuple[list[int], list[tuple]]) -> ScheduledBatch:
        drop, entries = msg
        for key in drop:
            self.mirrors.pop(key, None)
        reqs, counts = [], []
        for key, computed, n, new_toks, kind, ids, slot in entries:
            m = self.mirrors.get(key)
            if m is None:
                m = self.mirrors[key] = Mirror(key)
            m.token_ids.extend(new_toks)
            if kind == TABLE_NEW:
                m.block_table = list(ids)   # a new list object, as the BlockManager's rebinding
            elif kind == TABLE_APPEND:
                m.block_table.extend(ids)
            m.num_computed_tokens = computed
            m.state_slot = slot
            reqs.append(m)
            counts.append(n)
        return ScheduledBatch(reqs, counts)
