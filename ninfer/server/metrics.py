"""Prometheus metrics, named as vLLM names them with a `ninfer:` prefix.

Each app gets its own CollectorRegistry, so several servers (tests) can live in one process.
Gauges that describe the engine (running, waiting, KV usage) are read at scrape time from the
engine thread's latest stats snapshot; counters and latency histograms are recorded by the
front end as outputs arrive (time.monotonic() intervals, never compared across processes)."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

# The `*_created` timestamp series double the exposition and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def stats_dict(stats: Any) -> dict[str, Any]:
    """EngineStats (a dataclass, a plain object or a dict) as a dict."""
    if stats is None:
        return {}
    if isinstance(stats, dict):
        return stats
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return dict(vars(stats))


def _first(d: dict[str, Any], *names: str, default: float = 0.0) -> float:
    for n in names:
        if d.get(n) is not None:
            return float(d[n])
    return default


def kv_usage_from_stats(d: dict[str, Any]) -> float:
    """Fraction of KV pages in use, 0..1."""
    if any(d.get(n) is not None for n in ("kv_cache_usage", "kv_usage", "kv_cache_usage_perc")):
        return _first(d, "kv_cache_usage", "kv_usage", "kv_cache_usage_perc")
    total = _first(d, "num_total_pages", "total_pages", "pages_total")
    free = _first(d, "num_free_pages", "free_pages", "pages_free")
    return (total - free) / total if total > 0 else 0.0


class ServerMetrics:
    def __init__(self, model_name: str, stats_fn: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self._stats_fn = stats_fn
        m = {"model_name": model_name}
        self._labels = m
        r = self.registry
        lbl = ["model_name"]

        running = Gauge("ninfer:num_requests_running", "Requests running in the engine (in a batch).", lbl, registry=r)
        waiting = Gauge("ninfer:num_requests_waiting", "Requests waiting for a running slot.", lbl, registry=r)
        usage = Gauge("ninfer:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).", lbl, registry=r)
        self._capacity = Gauge("ninfer:kv_cache_capacity_tokens", "Tokens the KV page pool holds.",
                               lbl + ["kv_dtype"], registry=r)
        running.labels(**m).set_function(lambda: _first(self._stats(), "num_running", "running"))
        waiting.labels(**m).set_function(lambda: _first(self._stats(), "num_waiting", "waiting"))
        usage.labels(**m).set_function(lambda: kv_usage_from_stats(self._stats()))
        for name, field, what in (("kv_cache_free_pages", "num_free_pages", "KV-cache pages free (evictable cached ones included)"),
                                  ("kv_cache_total_pages", "num_total_pages", "KV-cache pages in the pool")):
            Gauge(f"ninfer:{name}", what + ".", lbl, registry=r).labels(**m).set_function(
                lambda f=field: _first(self._stats(), f))
        # Counted by the engine (its running totals are mirrored at scrape time, see render()).
        self._mirrored = {
            "num_preemptions": Counter("ninfer:num_preemptions", "Requests preempted (pages reclaimed, recomputed later).",
                                       lbl, registry=r).labels(**m),
            "prefix_cache_queries": Counter("ninfer:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", lbl, registry=r).labels(**m),
            "prefix_cache_hits": Counter("ninfer:prefix_cache_hits",
                                         "Prompt tokens served from the prefix cache.", lbl, registry=r).labels(**m),
        }
        self._mirrored_seen = {k: 0.0 for k in self._mirrored}

        self.prompt_tokens = Counter("ninfer:prompt_tokens", "Prompt tokens of finished requests.", lbl, registry=r).labels(**m)
        self.generation_tokens = Counter("ninfer:generation_tokens", "Generated tokens.", lbl, registry=r).labels(**m)
        self._success = Counter("ninfer:request_success", "Finished requests by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("ninfer:time_to_first_token_seconds", "Arrival to first generated token.",
                              lbl, buckets=_LATENCY_BUCKETS, registry=r).labels(**m)
        self.itl = Histogram("ninfer:inter_token_latency_seconds", "Time between generated tokens.",
                             lbl, buckets=_ITL_BUCKETS, registry=r).labels(**m)
        self.e2e = Histogram("ninfer:e2e_request_latency_seconds", "Arrival to last token.",
                             lbl, buckets=_E2E_BUCKETS, registry=r).labels(**m)
        self.prompt_len = Histogram("ninfer:request_prompt_tokens", "Prompt length of finished requests.",
                                    lbl, buckets=_pow2_buckets(1 << 21), registry=r).labels(**m)
        self.gen_len = Histogram("ninfer:request_generation_tokens", "Generated length of finished requests.",
                                 lbl, buckets=_pow2_buckets(1 << 18), registry=r).labels(**m)
        self.http_errors = Counter("ninfer:request_errors", "Requests refused or failed, by HTTP status.",
                                   lbl + ["status"], registry=r)

    def engine_ready(self, kv_dtype: str, capacity_tokens: int) -> None:
        self._capacity.labels(model_name=self._labels["model_name"], kv_dtype=kv_dtype).set(capacity_tokens)
        # Recurrent-state slots exist only for models with linear-attention layers: gauges only then.
        stats = self._stats()
        for name, field, what in (("state_slots_free", "num_free_state_slots", "Recurrent-state slots free"),
                                  ("state_slots_total", "num_total_state_slots", "Recurrent-state slots in the pool")):
            if stats.get(field) is not None:
                Gauge(f"ninfer:{name}", what + ".", ["model_name"], registry=self.registry).labels(
                    **self._labels).set_function(lambda f=field: _first(self._stats(), f))

    def _stats(self) -> dict[str, Any]:
        return stats_dict(self._stats_fn())

    def record_finished(self, *, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                        e2e_s: float) -> None:
        self._success.labels(model_name=self._labels["model_name"], finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_len.observe(prompt_tokens)
        self.gen_len.observe(generation_tokens)
        self.e2e.observe(e2e_s)

    def record_error(self, status: int) -> None:
        self.http_errors.labels(model_name=self._labels["model_name"], status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        stats = self._stats()
        for name, counter in self._mirrored.items():
            total = _first(stats, name)
            if total > self._mirrored_seen[name]:
                counter.inc(total - self._mirrored_seen[name])
                self._mirrored_seen[name] = total
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _pow2_buckets(top: int) -> tuple[float, ...]:
    out, b = [], 1
    while b <= top:
        out.append(float(b))
        b *= 4
    return tuple(out)


class RequestLog:
    """`--request-log-jsonl`: one JSON object per request (ids, sizes, timings; never prompt text
    or the API key). Appends and flushes per event so a crash loses at most one line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def write(self, event: dict[str, Any]) -> None:
        if self._fh.closed:
            return
        self._fh.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
