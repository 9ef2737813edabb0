"""Decode CUDA graphs: one captured model forward per batch-size bucket, replayed for decode steps.

The seam (ninfer/engine/model_runner.py): at startup, before any request exists, the engine calls
``capture_decode_graphs(runner, batch_sizes) -> int``. It captures ``runner.eager_forward`` for
every bucket on static input buffers and installs a ``DecodeGraphs`` object as
``runner.forward_fn``. A decode step (``meta.is_decode``, B <= the largest bucket, block tables of
the runner's full width) replays the graph of the smallest bucket >= B, whose rows past B store
nothing (slot -1) and attend to nothing (seq_len 0); any other step runs eagerly. Logits and
sampling stay outside the graph.

Static buffers: the runner's persistent decode inputs (``runner.decode_inputs``, see
model_runner.DecodeInputs), reserved for the largest bucket and frozen: input_ids, positions,
slot_mapping [max_bs] int64, seq_lens [max_bs] int32, query_start_loc = arange [max_bs+1] int32 (one
token per sequence), block_tables [max_bs, max_pages_per_seq] int32 (max_pages_per_seq covers
max_context). The runner's decode steps already sit in them, padding included, so a replay copies
nothing; inputs built elsewhere (tests, a caller's own metadata) are copied in and padded first,
and the runner is told to rewrite its rows in full on its next step.

Graph memory: all buckets share one private memory pool, captured largest first so the smaller
graphs reuse its blocks. ``capture`` warms every bucket up eagerly first (compiles the Triton
kernels, fills caches), then measures the device around the captures alone: the allocator's
reserved-bytes delta (the private pool) and the driver's free-memory delta (pool + graph exec
objects); the larger of the two plus the static buffers is what it returns, and what the engine
prints as ``graphs=<observed>/<planned>``.
"""
from __future__ import annotations

import bisect
import gc
import logging

import torch

from ninfer.attention.base import AttentionMetadata

log = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode graphs for a ModelRunner; callable as the runner's ``forward_fn``."""

    def __init__(self, runner, batch_sizes: list[int]) -> None:
        sizes = sorted({int(b) for b in batch_sizes if int(b) >= 1})
        if not sizes:
            raise ValueError("capture_decode_graphs: no batch size >= 1 to capture")
        if runner.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the runner is on {runner.device}")
        self.runner = runner
        self.sizes = sizes
        self.width = int(runner.max_pages_per_seq)
        io = self.io = runner.decode_inputs
        io.reserve(sizes[-1])  # the graphs hold these addresses: the buffers never move again
        self.input_ids, self.positions, self.slot_mapping = io.input_ids, io.positions, io.slot_mapping
        self.seq_lens, self.block_tables, self.query_start_loc = io.seq_lens, io.block_tables, io.query_start_loc
        self.state_slots, self.has_initial_state = io.state_slots, io.has_initial_state  # None: no recurrent layers
        self.static_bytes = io.nbytes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0
        self.device_bytes = 0
        self._ptrs = (self.input_ids.data_ptr(), self.positions.data_ptr(), self.slot_mapping.data_ptr(),
                      self.seq_lens.data_ptr(), self.block_tables.data_ptr())

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.width * int(self.runner.page_size), is_decode=True,
            state_slots=None if self.state_slots is None else self.state_slots[:bs],
            has_initial_state=None if self.has_initial_state is None else self.has_initial_state[:bs])

    def _run(self, bs: int) -> torch.Tensor:
        return self.runner.eager_forward(self.input_ids[:bs], self.positions[:bs], self._meta(bs))

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket; returns the observed graph memory in bytes (see module doc)."""
        dev = self.runner.device
        # Dummy decode rows: attend to slot 0 of page 0 (a real page), store nothing; state slot 0
        # (the capture runs before any request holds one; the pool's states are zeroed after it).
        self.seq_lens.fill_(1)
        self.block_tables[:, 0] = 0
        if self.state_slots is not None:
            self.state_slots.fill_(0)
        side = _warmup_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up outside capture: Triton compiles, lazy caches fill
            for bs in reversed(self.sizes):
                self._run(bs)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        # torch.cuda.graph() empties the allocator's cache when it starts capturing; do it first
        # so the warm-up's cached blocks are not counted as a negative graph footprint.
        gc.collect()
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved(dev)
        free0 = torch.cuda.mem_get_info(dev)[0]
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[bs] = self._run(bs)
            self.graphs[bs] = g
        torch.cuda.synchronize(dev)
        self.pool_bytes = torch.cuda.memory_reserved(dev) - reserved0
        self.device_bytes = free0 - torch.cuda.mem_get_info(dev)[0]
        self.io.clear()  # back to padding everywhere, no rows owned
        states = self.runner.state_pool
        if states is not None:
            states.reset_states(list(range(states.num_slots)))
        observed = max(self.pool_bytes, self.device_bytes) + self.static_bytes
        log.info("decode CUDA graphs: sizes=%s pool=%d device=%d static=%d observed=%d bytes",
                 self.sizes, self.pool_bytes, self.device_bytes, self.static_bytes, observed)
        return observed

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b = int(input_ids.shape[0])
        if (not meta.is_decode or b == 0 or b > self.sizes[-1]
                or meta.block_tables.shape != (b, self.width) or not self.graphs):
            return self.runner.eager_forward(input_ids, positions, meta)
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        # The runner's decode path hands views of the static buffers, padding rows already set.
        if (input_ids.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(), meta.seq_lens.data_ptr(),
                meta.block_tables.data_ptr()) != self._ptrs:
            self._copy_in(b, bs, input_ids, positions, meta)
        self.graphs[bs].replay()
        # A view of the graph's static output: valid until the next replay (the runner consumes
        # it at once for the logits of the sampling rows).
        return self.outputs[bs][:b]

    def _copy_in(self, b: int, bs: int, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:b].copy_(meta.block_tables, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:b].copy_(meta.state_slots, non_blocking=True)
            self.has_initial_state[:b].copy_(meta.has_initial_state, non_blocking=True)
            self.state_slots[b:bs].fill_(-1)
            self.has_initial_state[b:bs].fill_(False)
        if bs > b:  # padding rows: store nothing, attend to nothing (rows left by a larger batch)
            self.input_ids[b:bs].zero_()
            self.positions[b:bs].zero_()
            self.slot_mapping[b:bs].fill_(-1)
            self.seq_lens[b:bs].zero_()
            self.block_tables[b:bs].fill_(-1)
        self.io.forget()  # its knowledge of the device rows is void now


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def _warmup_stream(dev: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device for the whole process: torch keeps a cuBLAS workspace per
    (handle, stream) until exit (32 MiB on Hopper), so a fresh stream per engine start made every
    later start see 32 MiB less free memory (the frontier's second start was refused, 2026-11-30)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[idx] = torch.cuda.Stream(idx)
    return _WARMUP_STREAMS[idx]


def capture_decode_graphs(runner, batch_sizes: list[int]) -> int:
    """Capture decode graphs for ``batch_sizes``, install them as ``runner.forward_fn`` and return
    the observed graph memory in bytes. Call once at startup, before any request holds pages."""
    graphs = DecodeGraphs(runner, batch_sizes)
    observed = graphs.capture()
    runner.forward_fn = graphs
    runner.decode_graphs = graphs  # for stats / debugging
    return observed
