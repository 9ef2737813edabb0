"""ninfer-serve's reliability suite, CPU, loopback, bounded loops: a long prefill does not stall a
short request and an abort lands within a step; tokenizing a huge prompt does not delay others;
hostile bodies (invalid Unicode, bad types, non-finite numbers, unknown roles, wrong content type)
get a 400 and keep the connection; random disconnects over mixed long and short streams; SIGTERM
with live streams drains them (a real `ninfer-serve` subprocess, a real signal); bad flags and
engines that cannot load are one line and a non-zero exit before the port is bound. After each
scenario: the server is healthy, every KV page is free, and nothing logged a traceback."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from tests.serve_proc import free_port, serve_cmd, serve_process
from tests.test_server import CHAT, KEY, REPO, LiveServer, assert_envelope, make_server, post

LONG_CONTEXT = 9216


class LogTrap(logging.Handler):
    """Every record of the server's, uvicorn's and the engine's loggers; `tracebacks()` lists those
    that carry one (an exception logged, or a traceback in the text)."""

    NAMES = ("", "uvicorn", "uvicorn.error", "uvicorn.asgi", "ninfer")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [r.getMessage() for r in self.records
                if r.exc_info or "Traceback" in r.getMessage() or "CancelledError" in r.getMessage()]

    def __enter__(self) -> "LogTrap":
        for n in self.NAMES:
            logging.getLogger(n).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for n in self.NAMES:
            logging.getLogger(n).removeHandler(self)


def assert_whole(srv: LiveServer, trap: LogTrap) -> None:
    stats = srv.wait_idle()
    assert stats.num_free_pages == stats.num_total_pages
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    assert not trap.tracebacks(), trap.tracebacks()


@pytest.fixture(scope="module")
def long_model_dir(tiny_checkpoint: Any) -> Path:
    return tiny_checkpoint(max_position=16384)


@pytest.fixture(scope="module")
def srv(long_model_dir: Path) -> Iterator[LiveServer]:
    # The default step budget (8192 tokens) would prefill an 8K prompt in one step of seconds.
    s = make_server(long_model_dir, engine_kw={"max_context": LONG_CONTEXT, "kv_capacity": 2 * LONG_CONTEXT})
    s.wait_health()
    yield s
    s.stop()


@pytest.fixture()
def trap() -> Iterator[LogTrap]:
    with LogTrap() as t:
        yield t


AUTH = {"authorization": f"Bearer {KEY}"}


# ------------------------------------------------------------------------------------ fairness


def test_short_request_is_served_during_a_long_prefill_and_abort_is_prompt(srv: LiveServer, trap: LogTrap) -> None:
    long_ids = torch.randint(4, 380, (8000,), generator=torch.Generator().manual_seed(1)).tolist()
    body = json.dumps({"prompt": long_ids, "max_tokens": 1, "stream": True}).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    # A raw socket, so that hanging up does not wait for a read that blocks until the first token.
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:
        deadline = time.monotonic() + 10
        while srv.engine.last_stats.num_running < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        sent = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
        short_latency = time.monotonic() - sent
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # Served while the long prompt is still prefilling (it takes many seconds here: no event
        # of its stream yet), within a bound that one 8K-token step alone would break.
        sock.settimeout(0.05)
        got = b""
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                got += chunk
        assert b"data: {" not in got, got
        assert short_latency < 2.5, short_latency
    finally:
        sock.close()                   # hang up mid-prefill
    hung_up = time.monotonic()
    srv.wait_idle(timeout=30)
    assert time.monotonic() - hung_up < 2.5, "the abort waited for a long step to end"
    assert_whole(srv, trap)


# ------------------------------------------------------------------------------------ tokenizing


def test_huge_prompts_do_not_block_others(srv: LiveServer, trap: LogTrap) -> None:
    huge = "hello world the quick brown fox " * 100_000           # 3.2 MB: refused before tokenizing
    bound = srv.engine.max_token_bytes * 2 * LONG_CONTEXT
    near = ("hello world the quick brown fox " * (bound // 32))[: bound - 64]   # passes the pre-check
    results: dict[str, Any] = {}

    def send(name: str, body: dict) -> None:
        t = time.monotonic()
        results[name] = (httpx.post(f"{srv.url}/v1/completions", headers=AUTH, json=body, timeout=120),
                         time.monotonic() - t)

    threads = [threading.Thread(target=send, args=(n, {"prompt": p, "max_tokens": 1}))
               for n, p in (("huge", huge), ("near", near))]
    for th in threads:
        th.start()
    time.sleep(0.1)
    send("hi", {"prompt": "hi", "max_tokens": 1})
    for th in threads:
        th.join(120)
    hi, hi_s = results["hi"]
    assert hi.status_code == 200 and hi_s < 2.0, hi_s
    err = assert_envelope(results["huge"][0], 400)
    assert "maximum context length" in err["message"] and results["huge"][1] < 2.0
    assert_envelope(results["near"][0], 400)          # tokenized, then refused on its exact count
    assert_whole(srv, trap)


# ------------------------------------------------------------------------------------ hostile bodies


def test_hostile_bodies_get_400_and_keep_the_connection(srv: LiveServer, trap: LogTrap) -> None:
    bad_unicode = [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
        ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 1}', "stop.0"),
        ("/tokenize", '{"prompt": "x\\ud800"}', "prompt"),
    ]
    invalid = [
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": CHAT, "stream": "yes"},
        {"messages": CHAT, "seed": -3},
        {"messages": CHAT, "seed": 2 ** 80},
        {"messages": CHAT, "top_logprobs": 3},                  # needs logprobs: true
        {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
        {"messages": CHAT, "max_tokens": 0},
    ]
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        for path, body, param in bad_unicode:
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            err = assert_envelope(r, 400)
            assert "lone surrogate" in err["message"] and err["param"] == param, err
            assert r.headers.get("connection") != "close"
        for body in invalid:
            assert_envelope(c.post("/v1/chat/completions", json=body), 400)
        for raw in ('{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
                    '{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
                    '[1, 2]', '"just a string"', '{"messages": '):
            assert_envelope(c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
        # curl -d sends form encoding: the JSON body is still read as JSON
        r = c.post("/tokenize", content='{"prompt": "hello world"}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and r.json()["count"] > 0
        r = c.post("/v1/completions", content='{"prompt": "hi", "max_tokens": 1}', headers={"content-type": ""})
        assert r.status_code == 200
        # the same pooled connection served every request above: nothing dropped it
        assert c.get("/health").status_code == 200
    assert_whole(srv, trap)


def test_top_logprobs_are_the_models(long_model_dir: Path, trap: LogTrap) -> None:
    from ninfer.config import EngineConfig
    from ninfer.engine.engine import LLMEngine

    seen: list[torch.Tensor] = []

    def factory() -> LLMEngine:
        cfg = EngineConfig(model=str(long_model_dir), device="cpu", max_context=256, kv_capacity=4096,
                           kv_dtype="auto")
        engine = LLMEngine(cfg, progress=False)
        engine.logits_hook = lambda reqs, logits: seen.append(logits[0].double().clone())
        return engine

    s = make_server(long_model_dir, factory=factory)
    try:
        s.wait_health()
        for seed in range(3):
            seen.clear()
            body = {"messages": [{"role": "user", "content": f"seed {seed}: two plus two?"}], "max_tokens": 4,
                    "temperature": 1.0, "seed": seed, "logprobs": True, "top_logprobs": 5, "ignore_eos": True}
            content = post(s, "/v1/chat/completions", body, key=None).json()["choices"][0]["logprobs"]["content"]
            tok = s.engine.tokenizer
            assert len(content) == len(seen) == 4
            for entry, logits in zip(content, seen):
                ref = torch.log_softmax(logits, dim=-1)          # float64, from the raw logits
                vals, ids = ref.topk(5)
                assert [t["token"] for t in entry["top_logprobs"]] == [tok.decode([i]) for i in ids.tolist()]
                assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(vals.tolist(), abs=1e-5)
                same = [i for i in range(ref.numel()) if tok.decode([i]) == entry["token"]]   # bytes share a "\ufffd"
                assert any(abs(entry["logprob"] - ref[i].item()) < 1e-5 for i in same), entry
        r = post(s, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "logprobs": 2, "temperature": 0}, key=None)
        lp = r.json()["choices"][0]["logprobs"]
        assert all(len(d) <= 2 and max(d.values()) == pytest.approx(t) for d, t in zip(lp["top_logprobs"], lp["token_logprobs"]))
        s.wait_idle()
        assert not trap.tracebacks()
    finally:
        s.stop()


# ------------------------------------------------------------------------------------ load


@pytest.mark.parametrize("seed", [0, 1])
def test_random_disconnects_over_mixed_streams(srv: LiveServer, trap: LogTrap, seed: int) -> None:
    rng = random.Random(seed)
    plans = [(rng.choice([8, 30, 600, 2000]), rng.choice([2, 6, 20]), rng.choice([None, 0, 1, 3]))
             for _ in range(14)]      # (prompt tokens, max_tokens, hang up after this many data events)

    async def one(i: int, c: httpx.AsyncClient) -> str:
        n, max_tokens, quit_after = plans[i]
        ids = [rng.randrange(4, 380) for _ in range(n)]
        body = {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0.7, "seed": i}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            last = ""
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    last = line
                    if quit_after is not None and seen > quit_after:
                        return "quit"
            return last

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(i, c) for i in range(len(plans)))), 120)

    out = asyncio.run(main())
    assert all(o in ("quit", "data: [DONE]") for o in out), out
    assert_whole(srv, trap)


def test_free_page_gauge_and_max_tokens_default(long_model_dir: Path, trap: LogTrap) -> None:
    s = make_server(long_model_dir, serving_kw={"default_max_tokens": 5})
    try:
        s.wait_health()
        r = post(s, "/v1/completions", {"prompt": "hello", "ignore_eos": True}, key=None).json()
        assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
        stats = s.wait_idle()
        text = httpx.get(f"{s.url}/metrics").text
        assert f'ninfer:kv_cache_free_pages{{model_name="tiny"}} {float(stats.num_total_pages)}' in text
        assert f'ninfer:kv_cache_total_pages{{model_name="tiny"}} {float(stats.num_total_pages)}' in text
        assert not trap.tracebacks()
    finally:
        s.stop()


def test_state_slot_gauges_on_a_hybrid_model(tmp_path_factory: pytest.TempPathFactory, trap: LogTrap) -> None:
    from tests.tiny_models import make_hybrid_checkpoint

    s = make_server(make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid")), engine_kw={"max_num_seqs": 4})

    def gauge(name: str) -> float:
        text = httpx.get(f"{s.url}/metrics").text
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"ninfer:{name}{{")))

    try:
        s.wait_health()
        assert gauge("state_slots_total") == gauge("state_slots_free") == 4
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            assert gauge("state_slots_free") == 3           # the running request holds one
        s.wait_idle()
        deadline = time.monotonic() + 10
        while gauge("state_slots_free") != 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gauge("state_slots_free") == 4
        assert not trap.tracebacks()
    finally:
        s.stop()


# ------------------------------------------------------------------------------------ the process


def test_sigterm_drains_live_streams(long_model_dir: Path) -> None:
    """The real command: startup lines (default rk4v4-e8 KV), the API key, --max-tokens-default
    capping a request without max_tokens, then SIGTERM with four live streams: no new connection,
    three streams cut at the grace period with a final "abort" event and [DONE], one that ends
    inside it finishes normally, exit 0, no traceback."""
    import openai

    with serve_process(str(long_model_dir), "--device", "cpu", "--max-model-len", "4096", "--kv-capacity", "16384",
                       "--api-key", KEY, "--shutdown-timeout", "2", "--max-tokens-default", "3", "--disable-access-log",
                       timeout_s=90, env={"OMP_NUM_THREADS": "1"}) as srv:
        proc, url = srv.proc, srv.url
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert c.models.list().data[0].id == long_model_dir.name
        r = c.completions.create(model=long_model_dir.name, prompt="hello", extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"   # --max-tokens-default
        lines: dict[int, list[str]] = {}

        def stream(i: int, max_tokens: int) -> None:
            body = {"prompt": f"client {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                lines[i] = [line for line in r.iter_lines() if line]

        # three streams that outlive the grace period, one that ends inside it
        threads = [threading.Thread(target=stream, args=(i, n)) for i, n in enumerate((4000, 4000, 4000, 30))]
        for th in threads:
            th.start()
        time.sleep(1.0)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):      # no new connection is accepted
            httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 1}, headers=AUTH, timeout=5)
        rc = proc.wait(20)
        took = time.monotonic() - signalled
        for th in threads:
            th.join(10)
    log = srv.log
    assert "kv planes: kv_dtype=rk4v4-e8" in log and "KV capacity" in log and "ready on http://127.0.0.1" in log, log
    assert rc == 0 and took < 2 + 5, (rc, took, log)
    for i in range(4):
        assert lines[i][-1] == "data: [DONE]", (i, lines[i][-3:])
        final = json.loads(lines[i][-2][6:])["choices"][0]
        assert final["finish_reason"] == ("length" if i == 3 else "abort"), (i, final)
    assert "Traceback" not in log and "CancelledError" not in log and "ERROR" not in log, log


def test_bad_flags_fail_in_one_line() -> None:
    cases = [(["--port", "99999"], "port"), (["--host", "256.1.1.1"], "256.1.1.1"), (["--port", "http"], "port"),
             (["--shutdown-timeout", "-1"], "shutdown-timeout"), (["--max-tokens-default", "0"], "max-tokens-default")]
    procs = [subprocess.Popen(serve_cmd(*argv), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _ in cases]
    for (argv, says), proc in zip(cases, procs):
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 2 and stdout == "", (argv, proc.returncode, stdout, stderr)
        lines = stderr.splitlines()
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in stderr, (argv, stderr)


def test_engines_that_cannot_load_fail_before_binding(long_model_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """In-process (the imports are warm): `serve_main` exits 1 with one line, having bound nothing."""
    from ninfer.cli import serve_main

    truncated = tmp_path / "truncated"
    shutil.copytree(long_model_dir, truncated)
    shard = truncated / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    model = str(long_model_dir)
    cases = [  # (argv, exit status, what the one line says)
        ([model, "--temperature", "-1"], 2, "temperature"),
        ([model, "--kv-dtype", "int3"], 1, "int3"),
        ([str(tmp_path / "missing")], 1, "missing"),
        ([str(truncated), "--max-context", "4096"], 1, "safetensors"),
        ([model, "--max-context", "16K", "--kv-capacity", "16K", "--memory-limit", "0.001"], 1, "does not fit"),
        ([model, "--kv-capacity", "1K", "--max-context", "4K"], 1, "kv_capacity"),
        ([model, "--port", str(busy.getsockname()[1])], 1, "cannot listen"),
    ]
    try:
        for argv, status, says in cases:
            port = free_port()
            argv = [*argv, "--device", "cpu", *([] if "--port" in argv else ["--port", str(port)])]
            with pytest.raises(SystemExit) as exit_info:
                serve_main(argv)
            captured = capsys.readouterr()
            lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
            assert exit_info.value.code == status, (argv, captured)
            assert len(lines) == 1 and says in lines[0] and lines[0].startswith("ninfer-serve: error:"), (argv, lines)
            if "--port" not in argv[:-2]:
                with socket.socket() as probe:      # the port was never taken
                    probe.bind(("127.0.0.1", port))
    finally:
        busy.close()
