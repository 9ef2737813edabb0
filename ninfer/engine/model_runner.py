"""Scheduled batch -> model inputs -> logits of the rows that sample.

The runner flattens the step's new tokens (varlen, as vLLM does), builds the attention metadata
(slot mapping, cumulative query lengths, sequence lengths, page tables) on the host, moves it to
the device once, runs the model through `self.forward_fn` and returns float32 logits only for
sequences whose chunk reaches their last token (a partial prefill chunk samples nothing).

Decode steps (every sequence has exactly one new token) take the persistent path, `DecodeInputs`:
device-resident inputs with static shapes (`block_tables` `[rows, max_pages_per_seq]`, -1 padded,
`meta.is_decode = True`) that are updated incrementally, so a steady decode step costs one small
host-to-device copy. Each sequence keeps a row while it stays in consecutive decode batches; rows
are compact (`[0, B)`), so a batch entry's row need not be its batch index: `PreparedInputs.rows`
maps batch entries to rows, and `sample_rows` picks the hidden rows of the sampling entries in
batch order, so logits stay in batch order. Other steps (prefill, mixed) build fresh tensors.

CUDA-graph seam: `self.forward_fn(input_ids [T], positions [T], meta) -> hidden [T, H]` defaults to
the eager model call. When the device is CUDA and `enforce_eager` is off, the engine calls
`ninfer.engine.cuda_graphs.capture_decode_graphs(runner, batch_sizes) -> int` (bytes of the graph
pool, reported in the capacity line) once at startup, before any request exists (so the capture
may write to any page). It captures on `runner.decode_inputs`' device buffers (fixed from then on)
and replaces `runner.forward_fn` with a callable that replays the graph of the smallest bucket
>= B on them (the padding rows are already "store nothing, attend to nothing"), copies inputs built
elsewhere into them first, and calls `runner.eager_forward` for anything else. Logits and sampling
stay outside the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ninfer.attention.base import AttentionMetadata, BaseAttentionBackend
from ninfer.engine.decode_inputs import DecodeInputs, PreparedInputs
from ninfer.engine.request import Request

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass
class ScheduledBatch:
    """One step's work: `num_new_tokens[i]` tokens of `requests[i]`, starting at its num_computed_tokens."""
    requests: list[Request]
    num_new_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def samples(self, i: int) -> bool:
        r = self.requests[i]
        return r.num_computed_tokens + self.num_new_tokens[i] == r.num_tokens


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: BaseAttentionBackend, *, device: torch.device,
                 page_size: int, max_pages_per_seq: int) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.forward_fn: ForwardFn = self.eager_forward
        self._pin = device.type == "cuda"
        # Sequence slots (recurrent states, window rings): steps carry state slots, fresh states are zeroed.
        pool = getattr(backend, "pool", None)
        self.state_pool = pool if getattr(pool, "num_slots", 0) else None
        self.decode_inputs = DecodeInputs(device, max_pages_per_seq, page_size, states=self.state_pool is not None)
        # Window rings: who holds each slot, (request, its block_table list) -- the BlockManager rebinds the
        # list on every allocation, so a new pair is a new occupancy, whose first computed position is
        # where its ring starts (pool.window_start; positions before it come from the pages).
        self._ring_owner: list = [None] * (pool.num_slots if getattr(pool, "windows", None) else 0)

    def eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.backend)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return (t.pin_memory() if self._pin else t).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> PreparedInputs:
        if batch.is_decode and batch.requests:
            inp = self.decode_inputs.prepare(batch.requests)
            if inp is not None:
                return inp
        return self.prepare_plain(batch)

    def prepare_plain(self, batch: ScheduledBatch) -> PreparedInputs:
        """Fresh tensors from the requests' lists: prefill / mixed steps (and the tests' reference)."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        sample_rows: list[int] = []
        sample_req: list[int] = []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = req.num_computed_tokens
            end = start + n
            if len(req.block_table) * ps < end:
                raise RuntimeError(f"request {req.request_id}: {len(req.block_table)} pages cannot hold {end} tokens")
            ids.extend(req.token_ids[start:end])
            pos.extend(range(start, end))
            bt = req.block_table
            slots.extend(bt[p // ps] * ps + p % ps for p in range(start, end))
            qlens.append(n)
            slens.append(end)
            if end == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_req.append(i)
        decode = batch.is_decode
        state_slots = has_init = None
        ring_start = [self.state_pool.window_start_cpu[r.state_slot] for r in batch.requests] \
            if self._ring_owner else None
        if self.state_pool is not None:
            state_slots = self._to_device(torch.tensor([r.state_slot for r in batch.requests], dtype=torch.int32))
            has_init = self._to_device(torch.tensor([r.num_computed_tokens > 0 for r in batch.requests]))
        width = self.max_pages_per_seq if decode else max(len(r.block_table) for r in batch.requests)
        tables = torch.full((len(batch.requests), width), -1, dtype=torch.int32)
        for i, req in enumerate(batch.requests):
            tables[i, : len(req.block_table)] = torch.tensor(req.block_table, dtype=torch.int32)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens, dtype=torch.int32), 0)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(torch.tensor(slots, dtype=torch.int64)),
            query_start_loc=self._to_device(qsl),
            seq_lens=self._to_device(torch.tensor(slens, dtype=torch.int32)),
            block_tables=self._to_device(tables),
            max_query_len=max(qlens), max_seq_len=max(slens), is_decode=decode,
            query_lens_cpu=qlens, seq_lens_cpu=slens, state_slots=state_slots, has_initial_state=has_init,
            window_start_cpu=ring_start,
        )
        return PreparedInputs(
            input_ids=self._to_device(torch.tensor(ids, dtype=torch.int64)),
            positions=self._to_device(torch.tensor(pos, dtype=torch.int64)),
            meta=meta, sample_rows=self._to_device(torch.tensor(sample_rows, dtype=torch.int64)),
            sample_req_idx=sample_req,
        )

    def _claim_rings(self, batch: ScheduledBatch) -> None:
        """Record where the ring of each sequence that just took its slot starts."""
        new = []
        for r in batch.requests:
            owner = self._ring_owner[r.state_slot]
            if owner is None or owner[0] is not r or owner[1] is not r.block_table:
                self._ring_owner[r.state_slot] = (r, r.block_table)
                new.append((r.state_slot, r.num_computed_tokens))
        if new:
            self.state_pool.set_window_start([s for s, _ in new], [v for _, v in new])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """Run one step. Returns (indices into batch of sampling sequences, their logits [N, V] float32)."""
        if self._ring_owner:
            self._claim_rings(batch)
        inp = self.prepare(batch)
        if self.state_pool is not None:  # a sequence without computed tokens starts from a zero state
            self.state_pool.reset_states([r.state_slot for r in batch.requests if r.num_computed_tokens == 0])
        self.backend.plan(inp.meta)  # per-step work once, not per layer
        hidden = self.forward_fn(inp.input_ids, inp.positions, inp.meta)
        if not inp.sample_req_idx:
            return [], None
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        return inp.sample_req_idx, logits.float()
