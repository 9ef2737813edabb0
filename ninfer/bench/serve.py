"""Serving benchmark: a load generator over the OpenAI API, as vLLM's `bench serve`.

    ninfer bench serve --url http://127.0.0.1:8080 --num-requests 64 --request-rate 4
    ninfer bench serve --serve "/models/Qwen3-8B --max-context 34K" --kv-dtypes int8,rk4v4-e8 \\
        --input-len 32768 --output-len 128 --num-requests 12 --max-concurrency 4 --json out.json

Requests are streaming /v1/completions with token-id prompts of exactly --input-len tokens
(+- --range-ratio), made by tokenizing random words on the server itself (so any tokenizer works
and no two prompts share a first page: prefix reuse cannot flatter the numbers), and
`ignore_eos` so every request generates exactly its --output-len tokens. Arrivals are Poisson at
--request-rate (inf = all at once), at most --max-concurrency in flight. With --serve, one
`ninfer serve` subprocess per --kv-dtypes entry is started with those flags, benchmarked, then
stopped with SIGTERM. Reported per run: request and output-token throughput, TTFT, inter-token
latency (a chunk carrying k tokens after a gap dt counts k gaps of dt/k) and end-to-end latency,
each mean / p50 / p99, and failures."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from or had "
         "by word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him two "
         "has look more day could go come did number sound no most people my over know water than call first who "
         "may down side been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form sentence great think "
         "say help low line differ turn cause much mean before move right boy old too same tell does set three "
         "want air well also play small end put home read hand port large spell add even land here must big high "
         "such follow act why ask men change went light kind off need house picture try us again animal point "
         "mother world near build self earth father head stand own page should country found answer school grow "
         "study still learn plant cover food sun four between state keep eye never last let thought city tree "
         "cross farm hard start might story saw far sea draw left late run while press close night real life few "
         "north open seem together next white children begin got walk example ease paper group always music those "
         "both mark often letter until mile river car feet care second book carry took science eat room friend").split()


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="a running server (default http://127.0.0.1:8080 without --serve)")
    where.add_argument("--serve", default=None, metavar="FLAGS",
                       help='start `ninfer serve FLAGS` (one string: model dir and flags) for each --kv-dtypes entry')
    p.add_argument("--kv-dtypes", default=None, help="with --serve: comma-separated KV formats, one server each")
    p.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"), help="Bearer key (env NINFER_API_KEY)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--num-requests", type=_positive_int, default=32)
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals per second (default inf)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None, help="most requests in flight")
    p.add_argument("--input-len", type=_positive_int, default=256, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=_positive_int, default=64, help="generated tokens (default %(default)s)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from len*(1-r) .. len*(1+r) (default 0: fixed)")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) first (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for a --serve server")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH ('-' = stdout)")


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf): {text!r}")
    return v


def lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    s = sorted(values)

    def pct(q: float) -> float:   # linear interpolation, numpy's default
        k = (len(s) - 1) * q
        lo = math.floor(k)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)
    return {"mean": statistics.fmean(s), "p50": pct(0.5), "p99": pct(0.99)}


async def make_prompt(client: Any, rng: random.Random, n: int) -> list[int]:
    """Exactly n token ids: random words tokenized by the server, cut (and topped up) to length."""
    ids: list[int] = []
    while len(ids) < n:
        text = " ".join(rng.choice(WORDS) for _ in range(max(16, n - len(ids))))
        r = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        ids += r.json()["tokens"]
    return ids[:n]


async def one_request(client: Any, model: str, prompt: list[int], output_len: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    res = Result(ok=False, prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message")
                    return res
                done = (chunk.get("usage") or {}).get("completion_tokens", res.output_tokens)
                new = done - res.output_tokens
                if new <= 0:
                    continue
                now = time.perf_counter()
                if res.ttft is None:    # gaps inside a first chunk of several tokens are unknown
                    res.ttft = now - start
                else:
                    res.itl += [(now - last) / new] * new
                last = now
                res.output_tokens = done
        res.e2e = time.perf_counter() - start
        res.ok = res.output_tokens == output_len
        if not res.ok:
            res.error = f"generated {res.output_tokens} of {output_len} tokens"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.max_concurrency or args.num_requests, 1) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        model = args.model or r.json()["data"][0]["id"]
        rng = random.Random(args.seed)
        n = args.num_requests
        ins = lengths(rng, n, args.input_len, args.range_ratio)
        outs = lengths(rng, n, args.output_len, args.range_ratio)
        prompts = [await make_prompt(client, rng, k) for k in ins]
        for _ in range(args.warmup):
            await one_request(client, model, await make_prompt(client, rng, min(args.input_len, 64)), 2)
        gate = asyncio.Semaphore(args.max_concurrency or n)
        in_flight = peak = 0

        async def limited(i: int) -> Result:
            nonlocal in_flight, peak
            async with gate:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await one_request(client, model, prompts[i], outs[i])
                finally:
                    in_flight -= 1

        start = time.perf_counter()
        tasks = []
        for i in range(n):
            tasks.append(asyncio.ensure_future(limited(i)))
            if math.isfinite(args.request_rate) and i < n - 1:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, model, peak)


def summarize(results: list[Result], duration: float, model: str, peak_concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "model": model, "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "peak_concurrency": peak_concurrency,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: str, kv_dtype: str | None, timeout: float, api_key: str | None) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "ninfer", "serve", *shlex.split(flags), "--port", str(port),
           "--disable-access-log", "--log-level", "warning", *(["--kv-dtype", kv_dtype] if kv_dtype else [])]
    print("starting:", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    env = {**os.environ, **({"NINFER_API_KEY": api_key} if api_key else {})}
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ninfer bench serve: the server exited with status {proc.returncode} during startup")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"ninfer bench serve: the server was not healthy within {timeout:.0f}s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _line(name: str, res: dict[str, Any]) -> str:
    def ms(d: dict[str, Any]) -> str:
        return "/".join("n/a" if d[k] is None else f"{d[k] * 1e3:.1f}" for k in ("mean", "p50", "p99"))
    return (f"{name}: {res['completed']} ok, {res['failed']} failed in {res['duration_s']:.1f}s | "
            f"{res['request_throughput']:.2f} req/s, {res['output_throughput']:.1f} out tok/s | "
            f"TTFT ms mean/p50/p99 {ms(res['ttft_s'])} | ITL ms {ms(res['itl_s'])} | e2e ms {ms(res['e2e_s'])}")


def run(args: argparse.Namespace) -> int:
    from ninfer.bench import _timing as T

    if args.kv_dtypes and not args.serve:
        raise SystemExit("ninfer bench serve: --kv-dtypes needs --serve (a running server has one format)")
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate   # strict JSON
    runs: dict[str, Any] = {}
    if args.serve:
        for kv in (args.kv_dtypes.split(",") if args.kv_dtypes else [None]):
            proc, url = start_server(args.serve, kv, args.startup_timeout, args.api_key)
            try:
                runs[kv or "default"] = asyncio.run(run_load(url, args))
            finally:
                stop_server(proc)
            print(_line(kv or "default", runs[kv or "default"]), flush=True)
    else:
        runs["server"] = asyncio.run(run_load(args.url or "http://127.0.0.1:8080", args))
        print(_line("server", runs["server"]), flush=True)
    T.write_json(args.json, {"bench": "serve", "environment": T.environment(), "config": config, "runs": runs})
    return 0 if all(r["failed"] == 0 for r in runs.values()) else 1
