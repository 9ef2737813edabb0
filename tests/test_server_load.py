"""ninfer-serve under load and failure, CPU: clients that disconnect (streaming and not) abort
their requests and return their pages; 32 concurrent clients, some hanging up mid-stream, leave
the page pool whole and /health ok; 429 when the queue is full; engine failure -> 500 then 503;
the bundled probe model. Helpers are test_server.py's; the `ninfer-serve` command itself is in
test_server_faults.py."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
import pytest

from ninfer.config import EngineConfig
from ninfer.server.app import AppSettings
from tests.test_server import CHAT, KEY, MAX_CONTEXT, MODEL, REPO, LiveServer, assert_envelope, make_server


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve_load") / "requests.jsonl"


def slow_engine(model_dir: Path, step_delay: float = 0.01, **engine_kw: Any) -> Callable[[], Any]:
    """A factory of the real engine whose every sampling step takes at least `step_delay` seconds,
    so a 200-token request reliably outlives a client that hangs up, however fast the machine."""
    from ninfer.engine.engine import LLMEngine

    def factory() -> LLMEngine:
        cfg = EngineConfig(**{"model": str(model_dir), "device": "cpu", "max_context": MAX_CONTEXT,
                              "kv_capacity": 4096, "max_num_seqs": 8, "kv_dtype": "auto", **engine_kw})
        engine = LLMEngine(cfg, progress=False)
        engine.logits_hook = lambda reqs, logits: time.sleep(step_delay)
        return engine

    return factory


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, log_path: Path):
    s = make_server(tiny_model_dir, settings=AppSettings(api_key=KEY, request_log_jsonl=str(log_path)),
                    factory=slow_engine(tiny_model_dir))
    s.wait_health()
    yield s
    s.stop()


def _long_body(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": stream}


def test_disconnects_abort_and_return_pages(srv: LiveServer, log_path: Path) -> None:
    # streaming: read two chunks, hang up
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{srv.url}/v1/completions", json=_long_body(True),
                      headers={"authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith("data: ") for line in got)
    srv.wait_idle()
    # a chat stream of n=3 choices (three engine requests): all three are aborted
    with httpx.Client(timeout=60) as c:
        body = {"model": MODEL, "messages": CHAT, "n": 3, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", f"{srv.url}/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(10)]
            assert sum('"role":"assistant"' in line for line in got) == 3
    srv.wait_idle()
    # non-streaming: the client times out and closes the connection mid-generation
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=_long_body(False), timeout=1.0,
                   headers={"authorization": f"Bearer {KEY}"})
    srv.wait_idle()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:     # the log line is written when the abort is handled
        events = [json.loads(line) for line in log_path.read_text().splitlines()]
        if len([e for e in events if e["status"] == 499]) == 5:
            break
        time.sleep(0.05)
    aborted = [e for e in events if e["status"] == 499]
    assert len(aborted) == 5 and all(e["finish_reason"] == "abort" and e["completion_tokens"] < 200 for e in aborted)


def test_concurrent_load_then_pool_whole(srv: LiveServer) -> None:
    n_clients, quitters = 32, set(range(0, 32, 4))

    async def one(i: int, c: httpx.AsyncClient) -> tuple[int, str]:
        body = {"model": MODEL, "max_tokens": 4 if i not in quitters else 64, "ignore_eos": True,
                "stream": True, "temperature": 0.8, "seed": i,
                "messages": [{"role": "user", "content": f"client {i}: the magic number is {i * 7}"}]}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, await r.aread()
            seen: list[str] = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen.append(line)
                    if i in quitters and len(seen) >= 2:
                        return 200, "quit"
            return 200, seen[-1]

    async def main() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers={"authorization": f"Bearer {KEY}"},
                                     limits=httpx.Limits(max_connections=n_clients)) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(i, c) for i in range(n_clients))), 150)

    results = asyncio.run(main())
    assert all(status == 200 for status, _ in results), results
    assert all(last == "data: [DONE]" for i, (_, last) in enumerate(results) if i not in quitters)
    stats = srv.wait_idle()
    assert stats.num_free_pages == stats.num_total_pages
    assert httpx.get(f"{srv.url}/health").status_code == 200


# ------------------------------------------------------------------------------------ other servers


def test_queue_full_is_429(tiny_model_dir: Path) -> None:
    s = make_server(tiny_model_dir, settings=AppSettings(max_in_flight=1),
                    factory=slow_engine(tiny_model_dir, max_num_seqs=1))
    try:
        s.wait_health()
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=_long_body(True)) as r:
                lines = r.iter_lines()      # keep a reference: a collected iterator closes the stream
                assert next(lines).startswith("data: ")
                err = assert_envelope(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}), 429)
                assert "busy" in err["message"]
        s.wait_idle()
        # the slot is back: a new request is served
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60).status_code == 200
    finally:
        s.stop()


def test_engine_failure_fails_pending_requests_and_health(tiny_model_dir: Path) -> None:
    from ninfer.engine.engine import LLMEngine

    go = threading.Event()     # the step fails once both requests are in the engine

    def factory() -> LLMEngine:
        engine = slow_engine(tiny_model_dir, step_delay=0.02)()
        real_step = engine.step

        def failing_step():
            if go.is_set():
                raise RuntimeError("simulated device failure")
            return real_step()

        engine.step = failing_step
        return engine

    s = make_server(tiny_model_dir, factory=factory)
    try:
        s.wait_health()
        result: dict[str, httpx.Response] = {}
        plain = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{s.url}/v1/completions", json=_long_body(False), timeout=60)))
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=_long_body(True)) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                plain.start()
                deadline = time.monotonic() + 20
                while s.engine.last_stats.num_running < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                go.set()
                rest = [line for line in lines if line]
        plain.join(60)
        # the stream ends with an error event and [DONE]; the non-streaming request gets a 500
        assert rest[-1] == "data: [DONE]" and "simulated device failure" in json.loads(rest[-2][6:])["error"]["message"]
        err = assert_envelope(result["r"], 500)
        assert "simulated device failure" in err["message"]
        s.wait_health(503)
        assert_envelope(httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}, timeout=10), 503)
    finally:
        s.stop()


def test_engine_that_cannot_load_stays_503(tmp_path: Path) -> None:
    def factory():
        raise FileNotFoundError(f"no config.json in {tmp_path}")

    s = make_server(tmp_path, factory=factory)
    try:
        s.wait_health(503)
        err = assert_envelope(httpx.get(f"{s.url}/health"), 503)
        assert "config.json" in err["message"]
        assert_envelope(httpx.post(f"{s.url}/v1/chat/completions", json={"messages": CHAT}, timeout=10), 503)
    finally:
        s.stop()


@pytest.mark.skipif(not (REPO / "models" / "probe" / "config.json").is_file(),
                    reason="the bundled probe model (models/probe) is not in this checkout yet")
def test_default_model_is_the_bundled_probe() -> None:
    from ninfer.engine.engine import LLMEngine

    cfg = EngineConfig(model=None, device="cpu", max_context=MAX_CONTEXT, kv_capacity=4096, kv_dtype="auto")
    s = make_server(REPO / "models" / "probe", factory=lambda: LLMEngine(cfg, progress=False))
    try:
        s.wait_health()
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()
