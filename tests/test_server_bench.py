"""`ninfer bench serve` on CPU against the tiny model: the load generator's counts agree with
what it asked for and with the server's own Prometheus counters, concurrency stays under its
limit, percentiles match the standard library's, and --serve runs a real `ninfer serve` per KV
format and writes the JSON."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
from pathlib import Path

import httpx
import pytest

from ninfer.bench import serve as bench
from tests.test_server import make_server


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def _generated(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r'^ninfer:generation_tokens_total\{model_name="tiny"\} (\S+)', text, re.M).group(1))


def test_load_counts_and_concurrency(tiny_model_dir: Path) -> None:
    s = make_server(tiny_model_dir)
    try:
        s.wait_health()
        args = _args("--num-requests", "6", "--max-concurrency", "2", "--input-len", "40", "--output-len", "6",
                     "--range-ratio", "0.5", "--request-rate", "40", "--seed", "3")
        before = _generated(s.url)
        res = asyncio.run(bench.run_load(s.url, args))
        rng = random.Random(3)                      # the same draws as the bench makes
        ins, outs = bench.lengths(rng, 6, 40, 0.5), bench.lengths(rng, 6, 6, 0.5)
        assert res["completed"] == 6 and res["failed"] == 0, res["errors"]
        assert res["input_tokens"] == sum(ins) and res["output_tokens"] == sum(outs)
        assert _generated(s.url) - before == sum(outs) + 2      # + the warmup request's 2 tokens
        assert 1 <= res["peak_concurrency"] <= 2
        assert res["request_throughput"] == pytest.approx(6 / res["duration_s"])
        assert res["output_throughput"] == pytest.approx(sum(outs) / res["duration_s"])
        assert 0 < res["ttft_s"]["p50"] <= res["e2e_s"]["p50"] and res["itl_s"]["mean"] > 0
        s.wait_idle()
    finally:
        s.stop()


def test_percentiles_match_statistics() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        got = bench.percentiles(xs)
        ref = statistics.quantiles(xs, n=100, method="inclusive") if n > 1 else [xs[0]] * 99
        assert got["p50"] == pytest.approx(ref[49]) and got["p99"] == pytest.approx(ref[98])
        assert got["mean"] == pytest.approx(statistics.fmean(xs))
    assert bench.percentiles([]) == {"mean": None, "p50": None, "p99": None}


def test_serve_flag_starts_servers_and_writes_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    args = _args("--serve", f"{tiny_model_dir} --device cpu --max-context 512 --kv-capacity 4096",
                 "--kv-dtypes", "auto", "--num-requests", "2", "--input-len", "30", "--output-len", "3",
                 "--warmup", "0", "--json", str(out))
    assert bench.run(args) == 0
    data = json.loads(out.read_text())
    run = data["runs"]["auto"]
    assert data["bench"] == "serve" and run["completed"] == 2 and run["output_tokens"] == 6
    assert data["config"]["request_rate"] == "inf" and "api_key" not in data["config"]
