"""The FastAPI app: routes, the lifespan that starts/stops the engine thread, the API-key and
body-size guards (plain ASGI middleware, so they also cover unknown paths), the exception
handlers that turn every error into OpenAI's envelope `{"error": {message, type, param, code}}`,
and `DrainingServer`, uvicorn with a drain at SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import ninfer
from ninfer.server.async_engine import AsyncEngine
from ninfer.server.endpoints import create_chat_completion, create_completion
from ninfer.server.metrics import RequestLog, ServerMetrics
from ninfer.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from ninfer.server.serving import APIError, OpenAIServing, ServingConfig, message_texts

log = logging.getLogger("ninfer.server")

OPEN_PATHS = frozenset({"/health"})   # reachable without the API key (load balancers, probes)


@dataclass
class AppSettings:
    api_key: str | None = None
    max_body_bytes: int = 64 << 20
    max_in_flight: int | None = None          # running + pending; beyond it requests get 429
    request_log_jsonl: str | None = None


def _envelope(status: int, message: str, param: str | None = None, type: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, param=param, type=type).body(), status_code=status)


async def _send_envelope(send: Send, status: int, message: str, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(APIError(status, message).body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Bearer API key on every path but OPEN_PATHS, and a request-body size limit (413), checked
    from Content-Length up front and counted while streaming in for chunked bodies. Every POST body
    here is JSON, so one sent without a JSON content type (`curl -d` says form-urlencoded) is read
    as JSON anyway."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope["method"] == "POST" and b"json" not in headers.get(b"content-type", b""):
            raw = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope = {**scope, "headers": raw + [(b"content-type", b"application/json")]}
        if self.api_key and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                await _send_envelope(send, 401, "Invalid or missing API key (send `Authorization: Bearer <key>`).",
                                     [(b"www-authenticate", b"Bearer")])
                return
        too_large = f"Request body exceeds the server's limit of {self.max_body} bytes."
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _send_envelope(send, 413, too_large)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    # FastAPI re-raises HTTPException from body reading; the handler makes it an envelope.
                    raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, limited_receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "invalid_unicode":   # the check walked the whole body: its path is exact
        where = e.get("ctx", {}).get("where") or None
        return str(e.get("msg")), where
    if e.get("type") == "json_invalid":
        return f"Malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    if param is None:    # the body as a whole: absent, or not a JSON object
        return f"request body: {e.get('msg')} (send a JSON object)" + more, None
    return f"{param}: {e.get('msg')}" + more, param


def create_app(engine_factory: Callable[[], Any], serving_config: ServingConfig,
               settings: AppSettings | None = None, *, on_engine_ready: Callable[[AsyncEngine], None] | None = None,
               on_engine_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """`engine_factory()` builds the LLMEngine; it runs on the engine thread once the app starts."""
    settings = settings or AppSettings()
    aengine = AsyncEngine(engine_factory, max_in_flight=settings.max_in_flight, on_failure=on_engine_failure)
    metrics = ServerMetrics(serving_config.served_model_name, lambda: aengine.last_stats)
    request_log = RequestLog(settings.request_log_jsonl) if settings.request_log_jsonl else None
    sv = OpenAIServing(aengine, serving_config, metrics, request_log)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start(asyncio.get_running_loop())   # the CLI may have started (built) it already
        announce = asyncio.create_task(_announce_ready())
        try:
            yield
        finally:
            announce.cancel()
            await asyncio.get_running_loop().run_in_executor(None, aengine.shutdown)
            aengine.fail_all_now()
            sv.close()
            if request_log is not None:
                request_log.close()

    async def _announce_ready() -> None:
        while not aengine.ready and aengine.error is None:
            await asyncio.sleep(0.05)
        if not aengine.ready:
            return
        serving_config.kv_dtype = aengine.kv_dtype or serving_config.kv_dtype
        metrics.engine_ready(serving_config.kv_dtype, aengine.kv_capacity_tokens)
        if on_engine_ready is not None:
            on_engine_ready(aengine)

    app = FastAPI(title="ninfer", version=ninfer.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = aengine
    app.state.serving = sv
    app.state.metrics = metrics
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        metrics.record_error(400)
        return _envelope(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.record_error(exc.status_code)
        return _envelope(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        metrics.record_error(500)
        return _envelope(500, f"internal error: {exc!r}")

    @app.get("/health")
    async def health() -> Response:
        if aengine.healthy:
            return Response(status_code=200)
        if aengine.draining:
            return _envelope(503, "the server is shutting down")
        if aengine.error is not None:
            return _envelope(503, f"engine failed: {aengine.error!r}")
        return _envelope(503, "engine is loading" if not aengine.ready else "engine thread stopped")

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ninfer.__version__}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        sv.check_model(None)
        card = ModelCard(id=serving_config.served_model_name, root=serving_config.model_path or None,
                         max_model_len=aengine.max_context, kv_dtype=serving_config.kv_dtype or None)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(sv, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await create_completion(sv, req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        sv.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of `prompt` or `messages`", param="prompt")
        sv.check_text_fits(message_texts(req.messages) if req.messages is not None else [req.prompt],
                           "messages" if req.messages is not None else "prompt")
        if req.messages is not None:
            ids = await sv.on_tokenizer(sv.chat_prompt_ids, req.messages, add_generation_prompt=req.add_generation_prompt,
                                        template_kwargs=req.chat_template_kwargs)
        else:
            ids = await sv.on_tokenizer(sv.prompt_ids, req.prompt, req.add_special_tokens)
        strs = None
        if req.return_token_strs:
            strs = await sv.on_tokenizer(lambda: sv.tokenizer.convert_ids_to_tokens(ids))
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=aengine.max_context, tokens=ids,
                                             token_strs=strs).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        sv.check_model(req.model)
        text = await sv.on_tokenizer(sv.detokenize, req.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown drains: from the first SIGTERM/SIGINT it accepts no connection and
    no request (503), lets running requests finish for up to `drain_timeout` seconds, then aborts
    the rest, each of which still gets its final event (finish_reason "abort", then [DONE]) or its
    JSON body, before the connections close. Nothing is cancelled mid-response."""

    FLUSH_S = 5.0   # after the aborts: time for handlers to write their last bytes

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        config.timeout_graceful_shutdown = drain_timeout + self.FLUSH_S
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout

    async def shutdown(self, sockets: Any = None) -> None:
        self.engine.begin_drain()
        deadline = asyncio.ensure_future(self._abort_at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_at_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.drain_timeout
        while self.engine.num_in_flight and loop.time() < end and not self.force_exit:
            await asyncio.sleep(0.05)
        if self.engine.num_in_flight:
            log.warning("shutdown: aborting %d request(s) still running after %.1fs",
                        self.engine.num_in_flight, self.drain_timeout)
            self.engine.abort_all()


def wait_for_health(url: str, timeout: float) -> bool:
    """Poll GET {url}/health until 200 or `timeout` seconds; for scripts and tests."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False
