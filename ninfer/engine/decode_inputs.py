"""Persistent decode-step inputs on the device (the model runner's fast path for decode steps).

A decode step (every sequence has exactly one new token) reuses device-resident inputs with
static shapes that are updated incrementally, so a steady decode step costs one small
host-to-device copy; CUDA graphs capture these very buffers (ninfer/engine/cuda_graphs.py). See
`DecodeInputs`. `PreparedInputs` is what either path of `ModelRunner.prepare` returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ninfer.attention.base import AttentionMetadata
from ninfer.engine.request import Request


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor | slice  # hidden rows of the sampling sequences' last tokens, in batch order
    sample_req_idx: list[int]    # which batch entries sample
    rows: list[int] | None = None  # decode path: the row of each batch entry (None: row i = entry i)


def _words(n: int) -> int:
    """int64 words holding n int32 values."""
    return (n + 1) // 2


def _head_words(rows: int, states: bool) -> int:
    return 4 * rows + _words(rows) + ((_words(rows) + -(-rows // 8)) if states else 0)


def _head_views(buf, rows: int, i32, b8=None) -> tuple:
    """(input_ids, positions, slot_mapping, sample_rows, seq_lens[, state_slots, has_initial_state])
    of a decode head: int64 regions of `rows`, then seq_lens int32 packed; with `b8` (a bool dtype:
    the model has recurrent states) also state_slots int32 and has_initial_state bool. Same layout
    for the host stage (numpy) and the device."""
    r, e = rows, 4 * rows + _words(rows)
    views = (buf[0:r], buf[r:2 * r], buf[2 * r:3 * r], buf[3 * r:4 * r], buf[4 * r:e].view(i32)[:r])
    if b8 is None:
        return views
    return (*views, buf[e:e + _words(r)].view(i32)[:r], buf[e + _words(r):e + _words(r) + -(-r // 8)].view(b8)[:r])


class DecodeInputs:
    """Persistent decode inputs on the device, one row per sequence of the decode batch.

    Device: `buf` int64 = head (see `_head_views`; rows >= B hold padding: slot -1, seq_len 0) +
    a scratch of `scratch_cap` block-table updates (flat indices int64, then values int32);
    `block_tables [rows, width]` int32 (rows >= B all -1); `query_start_loc = arange(rows + 1)`.
    What each device row holds is known on the host as (owner request, its block_table list object,
    entries written): BlockManager rebinds `block_table` on allocate/free (so preemption, abort and
    re-admission show up as a new list) and only appends to it in `append_slot`, so while owner and
    list are the same, only the entries past the written count are new.

    A step writes the head and the table updates into one host stage and moves them with one copy
    (more only when the updates exceed the scratch, e.g. many rows rewritten at once), then scatters
    the updates into `block_tables` on the device. On CUDA the two stages are pinned and alternate;
    see `_stage` for why reusing them is safe."""

    def __init__(self, device: torch.device, width: int, page_size: int, *, rows: int = 0,
                 scratch: int | None = None, states: bool = False) -> None:
        self.device = device
        self.states = states  # rows also carry state_slots / has_initial_state (recurrent layers)
        self.width = int(width)
        self.page_size = int(page_size)
        self.scratch_cap = int(scratch or max(4 * self.width, 1024))  # table entries per copy
        self.frozen = False   # set once CUDA graphs captured the buffers: they must never move
        self._cuda = device.type == "cuda"
        self._stages: list[torch.Tensor | None] = [None, None]
        self._events: list = [None, None]
        self._turn = 0
        self._alloc(rows)

    # -- buffers -----------------------------------------------------------------------------------
    def _alloc(self, rows: int) -> None:
        r, dev = int(rows), self.device
        self.rows, self._head = r, _head_words(r, self.states)
        with torch.inference_mode(False):  # plain tensors: graphs and tests may write them anywhere
            self.buf = torch.zeros(self._head + self.scratch_cap + _words(self.scratch_cap),
                                   dtype=torch.int64, device=dev)
            self.block_tables = torch.full((r, self.width), -1, dtype=torch.int32, device=dev)
            self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=dev)
            views = _head_views(self.buf, r, torch.int32, torch.bool if self.states else None)
            self.input_ids, self.positions, self.slot_mapping, self.sample_idx, self.seq_lens = views[:5]
            self.state_slots, self.has_initial_state = views[5:] if self.states else (None, None)
            self.slot_mapping.fill_(-1)
            if self.states:
                self.state_slots.fill_(-1)
            self._bt_flat = self.block_tables.view(-1)
        self._np: list = [None, None]          # numpy views of the stages, for this layout
        self._views: dict[int, tuple] = {}     # batch size -> device views
        self._ident = list(range(r))
        self._reset_rows(0)

    def _reset_rows(self, written: int) -> None:
        """Forget row owners; every row is taken to hold `written` unknown entries (0: all -1)."""
        self._owner: list[Request | None] = [None] * self.rows
        self._table: list[list[int] | None] = [None] * self.rows
        self._len = [written] * self.rows
        self._used = self.rows if written else 0   # rows that may hold entries
        self._row_of: dict[Request, int] = {}

    def forget(self) -> None:
        """Someone else wrote the device buffers: rewrite every row in full on the next step."""
        self._reset_rows(self.width)

    def clear(self) -> None:
        """Device back to all padding (after the graphs' capture wrote dummy rows)."""
        self.buf[: self._head].zero_()
        self.slot_mapping.fill_(-1)
        if self.states:
            self.state_slots.fill_(-1)
        self.block_tables.fill_(-1)
        self._reset_rows(0)

    def reserve(self, rows: int) -> None:
        """At least `rows` rows, and never reallocate again (CUDA graphs hold the addresses)."""
        if self.rows < rows:
            self._alloc(rows)
        self.frozen = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.buf, self.block_tables, self.query_start_loc))

    def _stage(self, s: int, words: int) -> tuple:
        # Why reuse is safe: the host writes stage s only after events[s] completed, and events[s]
        # is recorded on the stream right after the last copy that reads stage s was enqueued, so
        # those copies are done. Two stages let the host fill step N+1 while step N's copy may
        # still be queued (a step that samples nothing does not sync); the wait only blocks when
        # the device is more than a whole step behind. A stage is replaced only after that wait.
        ev = self._events[s]
        if ev is not None:
            ev.synchronize()
        st = self._stages[s]
        if st is None or st.numel() < words:
            with torch.inference_mode(False):
                st = torch.empty(max(words, 2 * (st.numel() if st is not None else 0)), dtype=torch.int64,
                                 pin_memory=self._cuda)
            self._stages[s], self._np[s] = st, None
        if self._np[s] is None:
            host = st.numpy()
            self._np[s] = (host, _head_views(host, self.rows, np.int32, np.bool_ if self.states else None))
        return (st, *self._np[s])

    def _record(self, s: int) -> None:
        if self._cuda:
            ev = self._events[s] if self._events[s] is not None else torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._events[s] = ev

    # -- host-side assembly (pure) -----------------------------------------------------------------
    def _assign(self, reqs: list[Request]) -> list[int]:
        """Rows [0, B) for the batch: members keep their row when it is < B, the rest fill the gaps."""
        b, row_of = len(reqs), self._row_of
        rows = [-1] * b
        taken = [False] * b
        for i, r in enumerate(reqs):
            x = row_of.get(r)
            if x is not None and x < b:
                rows[i], taken[x] = x, True
        if -1 in rows:
            free = iter([x for x in range(b) if not taken[x]])
            rows = [x if x >= 0 else next(free) for x in rows]
        self._row_of = dict(zip(reqs, rows))
        return rows

    def _table_updates(self, reqs: list[Request], rows: list[int]) -> tuple[list, int]:
        """Device block-table entries to write: [(row, start, stop, source list or None = -1)], count."""
        ops: list = []
        k = 0
        for r, x in zip(reqs, rows):
            bt = r.block_table
            n, n0 = len(bt), self._len[x]
            if self._owner[x] is r and self._table[x] is bt and n >= n0:
                if n > n0:                      # the table grew: only the new pages
                    ops.append((x, n0, n, bt))
                    k += n - n0
            else:                               # new owner or a new table: the whole row
                if n:
                    ops.append((x, 0, n, bt))
                if n0 > n:
                    ops.append((x, n, n0, None))
                k += max(n, n0)
                self._owner[x], self._table[x] = r, bt
            self._len[x] = n
        for x in range(len(reqs), self._used):  # rows left behind: back to -1
            if self._len[x]:
                ops.append((x, 0, self._len[x], None))
                k += self._len[x]
            self._owner[x] = self._table[x] = None
            self._len[x] = 0
        self._used = len(reqs)
        return ops, k

    def _dirty_words(self, k: int) -> int:
        full, rem = divmod(k, self.scratch_cap)
        return full * (self.scratch_cap + _words(self.scratch_cap)) + rem + _words(rem)

    def _write_updates(self, host: np.ndarray, ops: list, k: int) -> None:
        """Table updates into the stage after the head, in chunks of scratch_cap: [idx n | vals n]."""
        idx = np.empty(k, dtype=np.int64)
        vals = np.empty(k, dtype=np.int32)
        p, w = 0, self.width
        for x, start, stop, src in ops:
            n = stop - start
            idx[p:p + n] = np.arange(x * w + start, x * w + stop)
            vals[p:p + n] = -1 if src is None else src[start:stop]
            p += n
        o, cap = self._head, self.scratch_cap
        for c in range(0, k, cap):
            n = min(cap, k - c)
            host[o:o + n] = idx[c:c + n]
            host[o + n:o + n + _words(n)].view(np.int32)[:n] = vals[c:c + n]
            o += n + _words(n)

    # -- the step ----------------------------------------------------------------------------------
    def _transfer(self, stage: torch.Tensor, k: int) -> None:
        """Head + first chunk of table updates in one copy, then the scatter (and any more chunks)."""
        h, cap = self._head, self.scratch_cap
        n = min(k, cap)
        end = h + n + _words(n)
        self.buf[:end].copy_(stage[:end], non_blocking=True)
        done = 0
        while True:
            if n:
                self._bt_flat.index_put_((self.buf[h:h + n],), self.buf[h + n:h + n + _words(n)].view(torch.int32)[:n])
            done += n
            if done >= k:
                return
            n = min(k - done, cap)
            w = n + _words(n)
            self.buf[h:h + w].copy_(stage[end:end + w], non_blocking=True)
            end += w

    def prepare(self, reqs: list[Request]) -> PreparedInputs | None:
        """Inputs of a decode step over `reqs` (one new token each); None if the buffers are frozen
        smaller than the batch (the caller then builds them the plain way)."""
        b, ps = len(reqs), self.page_size
        if b > self.rows:
            if self.frozen:
                return None
            self._alloc(max(b, 2 * self.rows, 8))
        ids, pos, slots, slens, samp, sslots = [], [], [], [], [], []
        for i, r in enumerate(reqs):  # checked before any state changes
            c, bt = r.num_computed_tokens, r.block_table
            if len(bt) * ps <= c:
                raise RuntimeError(f"request {r.request_id}: {len(bt)} pages cannot hold {c + 1} tokens")
            ids.append(r.token_ids[c])
            pos.append(c)
            slots.append(bt[c // ps] * ps + c % ps)
            slens.append(c + 1)
            if c + 1 == len(r.token_ids):
                samp.append(i)
            if self.states:
                sslots.append(r.state_slot)
        try:
            rows = self._assign(reqs)
            ident = rows == self._ident[:b]
            ops, k = self._table_updates(reqs, rows)
            s = self._turn
            self._turn ^= 1
            stage, host, hv = self._stage(s, self._head + self._dirty_words(k))
            h_ids, h_pos, h_slot, h_samp, h_len = hv[:5]
            at = slice(0, b) if ident else rows
            h_ids[at], h_pos[at], h_slot[at], h_len[at] = ids, pos, slots, slens
            h_ids[b:], h_pos[b:], h_slot[b:], h_len[b:] = 0, 0, -1, 0   # padding rows for graph buckets
            if self.states:
                hv[5][at], hv[6][at] = sslots, [p > 0 for p in pos]  # pos = tokens computed before
                hv[5][b:], hv[6][b:] = -1, False
            h_samp[:len(samp)] = [rows[i] for i in samp]
            if k:
                self._write_updates(host, ops, k)
            try:
                self._transfer(stage, k)
            finally:  # whatever was enqueued from stage s is fenced
                self._record(s)
        except BaseException:
            self.forget()  # the host's idea of the rows may be ahead of the device now
            raise
        v = self._views.get(b)
        if v is None:
            v = self._views[b] = (self.input_ids[:b], self.positions[:b], self.slot_mapping[:b],
                                  self.seq_lens[:b], self.block_tables[:b], self.query_start_loc[:b + 1],
                                  *((self.state_slots[:b], self.has_initial_state[:b]) if self.states else (None, None)))
        if not ident:
            slens = [slens[i] for i in sorted(range(b), key=rows.__getitem__)]
        meta = AttentionMetadata(slot_mapping=v[2], query_start_loc=v[5], seq_lens=v[3], block_tables=v[4],
                                 max_query_len=1, max_seq_len=max(slens), is_decode=True,
                                 query_lens_cpu=[1] * b, seq_lens_cpu=slens, state_slots=v[6],
                                 has_initial_state=v[7])
        sample_rows = slice(0, b) if ident and len(samp) == b else self.sample_idx[:len(samp)]
        return PreparedInputs(v[0], v[1], meta, sample_rows, samp, rows)
