"""GPU timing for ``ninfer bench kernels``: medians after an L2 flush by reading, CUDA-graph
replays of several calls, and the device copy bandwidth every row is compared with."""
from __future__ import annotations

import math
from typing import Callable


def median_us(fn: Callable[[], object], rep_ms: int, warmup_ms: int = 10,
              flush: Callable[[], object] | None = None) -> float:
    """Median microseconds of fn over repeats, each after an untimed L2 flush: by default one that
    *reads* 256 MB (``flush`` replaces it).

    triton.testing.do_bench flushes by writing (``zero_()``): the L2 is then full of dirty lines,
    and the timed kernel pays for writing them back to HBM while it reads. On the H200 that added
    ~9 us to every 128K decode replay (int8 86.1 -> 77.5 us with a read flush, rk4v4-e8 per-call
    56.2 -> 52.8 us over 2 sets; docs/BENCHMARKS.md "Measurement corrections"), more to a graph
    of one call than to a graph of several, so it skewed the ratios between formats."""
    import statistics

    import torch

    if flush is None:
        flush_buf = torch.empty(64 << 20, dtype=torch.int32, device="cuda")

        def flush():
            flush_buf.sum()

    def one() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush()
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    est = statistics.median(one() for _ in range(3))
    for _ in range(max(1, int(warmup_ms / max(est, 1e-3)))):
        fn()
    n = max(5, min(5000, int(rep_ms / max(est, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1000.0


def capture_graph(calls: list[Callable[[], object]]):
    """The calls run once on a side stream (compile / first-use builds happen there, outside the
    graph), then are captured in order into one CUDA graph, replayed once."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    return g


# A timed replay holds at least this many calls, whatever the format's page sets: a replay's first
# call costs ~3 us more than the calls after it (H200; docs/BENCHMARKS.md "Measurement
# corrections"), which a graph of one call (int8 or SDPA at 128K) charged in full and a graph of
# two (rk4v4-e8) by half.
MIN_CALLS = 8


def replay_sets(sets: int) -> list[int]:
    """The page set of each call in a timed replay: 0, 1, .., sets - 1 repeated to at least MIN_CALLS
    calls, so a set is read again only after all the others (together >= 4x the L2, ``sets_for``)."""
    return [i % sets for i in range(sets * math.ceil(MIN_CALLS / sets))]


def time_graph(calls: list[Callable[[], object]], rep_ms: int) -> float:
    """Median microseconds per call: the calls are captured once into a CUDA graph, replayed under
    ``median_us``, and the replay time is divided by len(calls)."""
    g = capture_graph(calls)
    us = median_us(g.replay, rep_ms, warmup_ms=max(10, rep_ms // 8))
    del g
    return us / len(calls)


def copy_bandwidth(rep_ms: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), 2 GiB buffers."""
    import torch

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    us = median_us(lambda: b.copy_(a), rep_ms, warmup_ms=25)
    del a, b
    return 2.0 * n / (us * 1e-6)
