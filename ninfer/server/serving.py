"""OpenAI semantics on top of AsyncEngine: request -> prompt ids + SamplingParams, length checks,
then a non-streaming body or an SSE stream, with metrics, the request log and disconnect -> abort.

All tokenizer work runs on a small pool of worker threads, each with its own copy of the
tokenizer (HF fast tokenizers must not be used from two threads at once): a 100K-token prompt
neither stalls the event loop nor queues a short request behind it. Before any tokenizing, text
that cannot fit the context whatever the tokenizer does (more than max_context x the longest
token's bytes) is refused at once."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from ninfer.server.async_engine import (AsyncEngine, EngineDeadError, EngineNotReadyError,
                                        QueueFullError, RequestStream, StepOutput)
from ninfer.server.errors import APIError
from ninfer.server.metrics import RequestLog, ServerMetrics
from ninfer.server.prompts import PromptTokenizing, message_texts  # noqa: F401  (re-exported)
from ninfer.server.protocol import SamplingFields

log = logging.getLogger("ninfer.server")

TOKENIZER_THREADS = 4
@dataclass
class ServingConfig:
    served_model_name: str
    model_path: str = ""                      # also accepted as a model name
    default_max_tokens: int | None = None     # None: up to what the context leaves
    no_thinking: bool = False
    greedy: bool = False                      # force temperature 0 on every request
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    kv_dtype: str = ""
    reasoning_parser: str = "auto"            # a ninfer.server.reasoning name, "auto" (from the template) or "none"
    tool_call_parser: str = "auto"            # a ninfer.server.tool_parsers name, "auto" or "none"


@dataclass
class Tracker:
    """Timing and counts of one request, for the usage block, metrics and the request log."""
    request_id: str
    endpoint: str
    arrival: float
    prompt_tokens: int = 0
    max_tokens: int = 0
    stream: bool = False
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    status: int = 200
    error: str | None = None                  # the error type when status >= 400
    done: bool = False                        # metrics and the log event are recorded


class OpenAIServing(PromptTokenizing):
    def __init__(self, engine: AsyncEngine, config: ServingConfig, metrics: ServerMetrics,
                 request_log: RequestLog | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.request_log = request_log
        self._tok_pool = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="ninfer-tokenizer")
        self._tok_local = threading.local()
        self._params_cls: Callable[..., Any] | None = None

    def close(self) -> None:
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ helpers

    def check_model(self, name: str | None) -> None:
        if self.engine.error is not None:
            raise APIError(503, f"the engine has failed ({self.engine.error!r}); the server cannot serve requests")
        if not self.engine.ready:
            raise APIError(503, "the engine is still loading; retry when GET /health returns 200")
        if name is not None and name not in (self.config.served_model_name, self.config.model_path):
            raise APIError(404, f"The model `{name}` does not exist. This server serves "
                                f"`{self.config.served_model_name}`.", param="model")

    def sampling_params(self, req: SamplingFields, prompt_len: int, max_tokens: int | None, *,
                        param: str, logprobs: int | None) -> Any:
        """Validates the length against the context and builds SamplingParams."""
        ctx = self.engine.max_context
        if prompt_len >= ctx or (max_tokens is not None and prompt_len + max_tokens > ctx):
            want = prompt_len + (max_tokens or 1)
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{want} tokens ({prompt_len} in the {param}, {want - prompt_len} in the "
                                f"completion). Please reduce the length of the {param} or completion.",
                           param=param)
        cap = self.engine.kv_capacity_tokens
        need = prompt_len + (max_tokens or 1)
        if cap and need > cap:   # only when --kv-capacity is below the context: it could never run
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens = {need} tokens exceeds the KV "
                                f"cache capacity of {cap} tokens on this server", param=param)
        room = ctx - prompt_len
        if max_tokens is None:
            max_tokens = min(room, self.config.default_max_tokens or room)
        kw: dict[str, Any] = dict(self.config.sampling_defaults)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        if self.config.greedy:
            kw["temperature"] = 0.0
        kw.update(max_tokens=max_tokens, stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                  ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs)
        if self._params_cls is None:
            from ninfer.engine.sampling import SamplingParams
            self._params_cls = SamplingParams
        try:
            return self._params_cls(**kw)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from e

    def new_tracker(self, prefix: str, endpoint: str, arrival: float) -> Tracker:
        return Tracker(request_id=f"{prefix}-{uuid.uuid4().hex}", endpoint=endpoint, arrival=arrival)

    def log_ignored(self, req: Any, tracker: Tracker) -> None:
        unknown = req.unknown_fields() if hasattr(req, "unknown_fields") else []
        if unknown:
            log.info("%s: ignoring unknown fields %s", tracker.request_id, unknown)

    # ------------------------------------------------------------------ running a request

    async def submit(self, tracker: Tracker, prompt_ids: list[int], params: Any) -> RequestStream:
        tracker.prompt_tokens = len(prompt_ids)
        tracker.max_tokens = int(params.max_tokens or 0)
        try:
            return await self.engine.add_request(tracker.request_id, prompt_ids, params)
        except QueueFullError as e:
            raise APIError(429, str(e)) from e
        except (EngineDeadError, EngineNotReadyError) as e:
            raise APIError(503, str(e)) from e
        except ValueError as e:        # the engine's own checks (length vs KV capacity, ...)
            raise APIError(400, str(e)) from e
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("add_request failed")
            raise APIError(500, f"could not add the request: {e!r}") from e

    async def outputs(self, stream: RequestStream, tracker: Tracker) -> AsyncIterator[tuple[Any, list[StepOutput]]]:
        """Yield (latest RequestOutput, the step outputs it merges) until the request finishes.
        Aborts the request when the consumer stops early (client gone, task cancelled)."""
        try:
            while True:
                try:
                    steps = await stream.next_outputs()
                except EngineDeadError as e:
                    raise APIError(500, str(e)) from e
                for s in steps:
                    self._observe(tracker, s)
                last = steps[-1].output
                if last.finished and last.finish_reason == "error":
                    raise APIError(500, f"the engine failed this request: {last.error or 'unknown error'}")
                yield last, steps
                if last.finished:
                    return
        except APIError as e:
            tracker.status, tracker.error = e.status, e.type
            raise
        finally:
            if not stream.finished:
                self.engine.abort(tracker.request_id)
                tracker.finish_reason = tracker.finish_reason or "abort"
                tracker.status = 499          # nginx's "client closed request", for the log only
            self.finish(tracker)

    def _observe(self, tr: Tracker, step: StepOutput) -> None:
        out, t = step.output, step.time
        n = len(out.new_token_ids)
        if n:
            if tr.first_token is None:
                self.metrics.ttft.observe(max(0.0, t - tr.arrival))
                n_itl = n - 1
            else:
                n_itl = n
            if n_itl and tr.last_token is not None:
                dt = (t - tr.last_token) / n_itl
                for _ in range(n_itl):
                    self.metrics.itl.observe(dt)
            tr.first_token = tr.first_token or t
            tr.last_token = t
            self.metrics.generation_tokens.inc(n)
        tr.completion_tokens = len(out.token_ids)
        tr.cached_tokens = int(out.num_cached_tokens or 0)
        if out.finished:
            tr.finish_reason = out.finish_reason

    def finish(self, tr: Tracker) -> None:
        """Metrics and the request-log event of a request that reached the engine (once)."""
        if tr.done:
            return
        tr.done = True
        now = time.monotonic()
        if tr.error is None:
            self.metrics.record_finished(finish_reason=tr.finish_reason or "abort", prompt_tokens=tr.prompt_tokens,
                                         generation_tokens=tr.completion_tokens, e2e_s=now - tr.arrival)
        else:
            self.metrics.record_error(tr.status)
        self._log_event(tr, now)

    def fail(self, tr: Tracker, err: APIError) -> None:
        """A request refused before it reached the engine."""
        tr.status, tr.error = err.status, err.type
        self.metrics.record_error(err.status)
        self._log_event(tr, time.monotonic())

    def _log_event(self, tr: Tracker, now: float) -> None:
        if self.request_log is None:
            return
        self.request_log.write({
            "request_id": tr.request_id, "endpoint": tr.endpoint, "status": tr.status, "error": tr.error,
            "stream": tr.stream, "prompt_tokens": tr.prompt_tokens, "completion_tokens": tr.completion_tokens,
            "cached_tokens": tr.cached_tokens, "max_tokens": tr.max_tokens, "finish_reason": tr.finish_reason,
            "ttft_s": None if tr.first_token is None else round(tr.first_token - tr.arrival, 6),
            "e2e_s": round(now - tr.arrival, 6)})

    async def close_stream(self, stream: RequestStream | None, tracker: Tracker) -> None:
        """After a response ends. Normally a no-op; it matters when the client left before the SSE
        body generator ever ran (so its cleanup never did): abort and record the request."""
        if stream is not None and not stream.finished and not tracker.done:
            self.engine.abort(tracker.request_id)
            tracker.finish_reason, tracker.status = "abort", 499
            self.finish(tracker)

    async def merged_outputs(self, runs: list[tuple[RequestStream, Tracker]],
                             ) -> AsyncIterator[tuple[int, Any, list[StepOutput]]]:
        """(run index, latest output, its steps) of several requests as they arrive, until all finish.
        Closing this generator early (client gone) cancels the pumps, which abort their requests."""
        if len(runs) == 1:      # the common case, without the extra task
            async for last, steps in self.outputs(*runs[0]):
                yield 0, last, steps
            return
        queue: asyncio.Queue[tuple[int, Any, Any]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream, tracker: Tracker) -> None:
            try:
                async for last, steps in self.outputs(stream, tracker):
                    queue.put_nowait((i, last, steps))
            except APIError as e:
                queue.put_nowait((i, e, None))
            finally:
                queue.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, s, t)) for i, (s, t) in enumerate(runs)]
        try:
            remaining = len(runs)
            while remaining:
                i, last, steps = await queue.get()
                if last is None:
                    remaining -= 1
                elif isinstance(last, APIError):
                    raise last
                else:
                    yield i, last, steps
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_until_done(self, raw: Request, runs: list[tuple[RequestStream, Tracker]]) -> list[Any] | None:
        """Non-streaming: consume every output and return each request's last one. If the client
        leaves first, abort the requests and return None (there is nobody left to answer)."""

        async def consume() -> list[Any]:
            lasts: list[Any] = [None] * len(runs)
            async for i, last, _ in self.merged_outputs(runs):
                lasts[i] = last
            return lasts

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(wait_disconnect(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()   # -> outputs()'s finally aborts the requests
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        return None if work.cancelled() else work.result()


async def wait_disconnect(raw: Request) -> None:
    """Returns when the client has gone away. The body is already read, so the next ASGI message
    on this connection can only be `http.disconnect`."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
