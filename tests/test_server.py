"""ninfer-serve end to end on CPU: a real uvicorn on 127.0.0.1 (free port), the real LLMEngine on
the tiny random-weight checkpoint, the official `openai` client: chat and completions, streaming
and not, usage and cached tokens, stop strings, every error envelope, the API key, the request
log. Load, disconnects and failures are in test_server_load.py (which reuses the helpers here)."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
import pytest
import uvicorn

from ninfer.config import EngineConfig
from ninfer.server.app import AppSettings, create_app
from ninfer.server.serving import ServingConfig

KEY = "sk-test-123"
MODEL = "tiny"
MAX_CONTEXT = 256
REPO = Path(__file__).resolve().parent.parent


class LiveServer:
    """uvicorn in a thread on a socket bound to 127.0.0.1:0 (so the port is ours before it starts)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "uvicorn did not start"

    @property
    def engine(self) -> Any:
        return self.app.state.engine

    def wait_health(self, status: int = 200, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            got = httpx.get(f"{self.url}/health", timeout=5).status_code
            if got == status:
                return
            time.sleep(0.05)
        raise AssertionError(f"/health stayed {got}, wanted {status}")

    def wait_idle(self, timeout: float = 20) -> Any:
        """Wait until the engine holds no request and every page is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.last_stats
            if (s.num_running == 0 and s.num_waiting == 0 and s.num_free_pages == s.num_total_pages
                    and self.engine.num_in_flight == 0):
                return s
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: {self.engine.last_stats}, in flight {self.engine.num_in_flight}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def make_server(model_dir: Path, *, engine_kw: dict | None = None, settings: AppSettings | None = None,
                serving_kw: dict | None = None, factory: Callable[[], Any] | None = None) -> LiveServer:
    from ninfer.engine.engine import LLMEngine

    # kv_dtype "auto" (unquantized): the CPU reference path of the packed formats is much slower,
    # and this file tests the server; test_cli_serves... runs the default rk4v4-e8 end to end.
    cfg = EngineConfig(**{"model": str(model_dir), "device": "cpu", "max_context": MAX_CONTEXT,
                          "kv_capacity": 4096, "max_num_seqs": 8, "kv_dtype": "auto", **(engine_kw or {})})
    app = create_app(factory or (lambda: LLMEngine(cfg, progress=False)),
                     ServingConfig(served_model_name=MODEL, model_path=str(model_dir), **(serving_kw or {})),
                     settings or AppSettings())
    return LiveServer(app)


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve") / "requests.jsonl"


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, log_path: Path):
    s = make_server(tiny_model_dir, settings=AppSettings(api_key=KEY, max_body_bytes=256 << 10,
                                                         request_log_jsonl=str(log_path)))
    s.wait_health()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(srv: LiveServer, path: str, body: Any, *, key: str | None = KEY, raw: bool = False, **kw) -> httpx.Response:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    content = body if raw else json.dumps(body)
    return httpx.post(f"{srv.url}{path}", content=content, headers=headers, timeout=60, **kw)


def assert_envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


CHAT = [{"role": "user", "content": "What is two plus two?"}]


# ------------------------------------------------------------------------------------ happy paths


def test_health_models_metrics_tokenize(srv: LiveServer) -> None:
    assert httpx.get(f"{srv.url}/health").status_code == 200          # open without the key
    auth = {"authorization": f"Bearer {KEY}"}
    models = httpx.get(f"{srv.url}/v1/models", headers=auth).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_CONTEXT
    tok = post(srv, "/tokenize", {"model": MODEL, "prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_CONTEXT
    assert post(srv, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "hello world"
    chat_tok = post(srv, "/tokenize", {"messages": CHAT}).json()
    assert chat_tok["count"] > tok["count"]
    text = httpx.get(f"{srv.url}/metrics", headers=auth).text
    for name in ("ninfer:num_requests_running", "ninfer:num_requests_waiting", "ninfer:kv_cache_usage_perc",
                 f'ninfer:kv_cache_capacity_tokens{{kv_dtype="{srv.engine.kv_dtype}",model_name="tiny"}} 4096.0',
                 "ninfer:prompt_tokens_total", "ninfer:generation_tokens_total",
                 "ninfer:time_to_first_token_seconds_bucket", "ninfer:inter_token_latency_seconds_bucket",
                 "ninfer:e2e_request_latency_seconds_bucket", "ninfer:prefix_cache_hits_total",
                 "ninfer:prefix_cache_queries_total"):
        assert name in text, name


def test_chat_openai_client_stream_and_not(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    u = full.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content      # greedy: streaming and not agree


def test_completions_stop_strings_and_logprobs(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert base.object == "text_completion" and base.choices[0].finish_reason == "length"
    assert base.usage.completion_tokens == 12 and len(base.choices[0].logprobs.token_logprobs) == 12
    assert all(lp <= 0 for lp in base.choices[0].logprobs.token_logprobs)
    # a stop string taken from the greedy output: the same run must end right before it
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip()
                 and text.find(text[i:i + 2]) == i), None)
    # the checkpoint is seeded, so this output is fixed: a missing stop string is a failure, not a skip
    assert stop is not None, f"greedy output {text!r} has no usable stop string"
    cut = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == cut.choices[0].text


def test_several_choices_n_and_batched_prompts(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=2, seed=5,
                                          extra_body={"ignore_eos": True})
    single = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.prompt_tokens == single.usage.prompt_tokens and chat.usage.completion_tokens == 6
    prompts = ["hello world", "the quick brown fox"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage.completion_tokens == 8
    assert batch.choices[0].text == batch.choices[1].text     # greedy: both samples of a prompt agree
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == dict.fromkeys(range(4), "length")
    assert [texts[i] for i in range(4)] == [c.text for c in batch.choices]


def test_prefix_reuse_reported_as_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "Long context inference keeps every key and value of the prompt in a paged cache. " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 128
    assert second.usage.prompt_tokens_details.cached_tokens >= 64     # at least one full page reused


def test_unknown_fields_and_nulls_are_tolerated(srv: LiveServer) -> None:
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                           "some_vendor_field": {"x": 1}, "logit_bias": {}})
    assert r.status_code == 200, r.text
    nulls = dict.fromkeys(["n", "stream", "stop", "logprobs", "top_logprobs", "seed", "temperature", "user",
                           "stream_options", "ignore_eos", "presence_penalty"])
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, **nulls})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text


# ------------------------------------------------------------------------------------ errors


def test_error_envelopes(srv: LiveServer, client: openai.OpenAI) -> None:
    err = assert_envelope(post(srv, "/v1/chat/completions", b'{"model": "tiny", "messages": [', raw=True), 400)
    assert "JSON" in err["message"]
    err = assert_envelope(post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": -1}), 400)
    assert err["param"] == "max_tokens"
    err = assert_envelope(post(srv, "/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}), 400)
    assert err["param"] == "temperature"
    assert_envelope(post(srv, "/v1/completions", {"prompt": "hi", "top_p": 0}), 400)
    assert_envelope(post(srv, "/v1/chat/completions", {"messages": []}), 400)
    err = assert_envelope(post(srv, "/v1/completions", {"model": "gpt-nope", "prompt": "hi"}), 404)
    assert "gpt-nope" in err["message"] and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=CHAT)
    # prompt + max_tokens beyond the context: 400 with the numbers
    n = post(srv, "/tokenize", {"prompt": "hello world " * 60}).json()["count"]
    assert n < MAX_CONTEXT
    err = assert_envelope(post(srv, "/v1/completions", {"prompt": "hello world " * 60, "max_tokens": MAX_CONTEXT}), 400)
    assert f"maximum context length is {MAX_CONTEXT} tokens" in err["message"]
    assert f"{n + MAX_CONTEXT} tokens ({n} in the prompt, {MAX_CONTEXT} in the completion)" in err["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 400}])
    # oversized body: 413, by Content-Length and by a chunked body with no length
    big = json.dumps({"prompt": "x" * (300 << 10)})
    assert_envelope(post(srv, "/v1/completions", big, raw=True), 413)
    chunks = (big[i:i + 65536].encode() for i in range(0, len(big), 65536))
    assert_envelope(post(srv, "/v1/completions", chunks, raw=True), 413)
    assert_envelope(httpx.get(f"{srv.url}/v1/nothing-here", headers={"authorization": f"Bearer {KEY}"}), 404)
    err = assert_envelope(post(srv, "/v1/completions", {"prompt": [1, 2, 10**6], "max_tokens": 1}), 400)
    assert "vocabulary" in err["message"]
    assert_envelope(post(srv, "/detokenize", {"tokens": [-1]}), 400)
    assert_envelope(post(srv, "/v1/completions", {"prompt": ["a"] * 65, "n": 2}), 400)   # > 128 choices


def test_api_key_enforced(srv: LiveServer) -> None:
    for key in (None, "wrong"):
        assert_envelope(post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, key=key), 401)
        assert_envelope(post(srv, "/tokenize", {"prompt": "hi"}, key=key), 401)
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    assert httpx.get(f"{srv.url}/metrics").status_code == 401
    assert httpx.get(f"{srv.url}/health").status_code == 200
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()

def test_request_log_has_no_prompt_or_key(srv: LiveServer, log_path: Path) -> None:
    text = log_path.read_text()
    events = [json.loads(line) for line in text.splitlines()]
    assert events and all({"request_id", "status", "prompt_tokens", "e2e_s"} <= set(e) for e in events)
    assert {e["status"] for e in events} >= {200, 400, 404}
    assert KEY not in text and "quick brown fox" not in text and "two plus two" not in text

def test_no_thinking_sets_template_flag(tiny_model_dir: Path) -> None:
    from types import SimpleNamespace

    from tests.tiny_models import make_tokenizer
    from ninfer.server.metrics import ServerMetrics
    from ninfer.server.protocol import ChatMessage
    from ninfer.server.serving import OpenAIServing

    tok = make_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}")
    engine = SimpleNamespace(tokenizer=tok)
    msgs = [ChatMessage(role="user", content=[{"type": "text", "text": "hi"}])]
    for flag, expect in ((True, True), (False, False)):
        sv = OpenAIServing(engine, ServingConfig(served_model_name=MODEL, no_thinking=flag),
                           ServerMetrics(MODEL, lambda: None))
        text = tok.decode(sv.chat_prompt_ids(msgs, add_generation_prompt=True))
        sv.close()
        assert ("NOTHINK" in text) == expect and "user: hi" in text


def test_cli_flags_and_vllm_aliases() -> None:
    import argparse

    from ninfer.server import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args([])
    assert (a.model, a.host, a.port, a.api_key or None, a.greedy, a.no_thinking) == (None, "127.0.0.1", 8080, None,
                                                                                     False, False)
    assert a.max_tokens_default == cli.DEFAULT_MAX_TOKENS == 8192 and a.shutdown_timeout == 10.0
    assert cli.served_name(None, None) == "probe" and cli.served_name("/m/Qwen3-8B/", None) == "Qwen3-8B"
    a = p.parse_args(["/m/x", "--max-model-len", "32K", "--kv-cache-dtype", "int8", "--max-num-seqs", "3",
                      "--enforce-eager", "--no-enable-prefix-caching", "--max-pending-requests", "0",
                      "--default-max-tokens", "1k", "--greedy", "--no-thinking", "--temperature", "0.6"])
    assert (a.max_context, a.kv_dtype, a.max_num_seqs, a.enforce_eager, a.enable_prefix_caching) == (
        32768, "int8", 3, True, False)
    assert (a.max_pending_requests, a.max_tokens_default, a.greedy, a.no_thinking, a.temperature) == (
        0, 1024, True, True, 0.6)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-pending-requests", "-1"])
