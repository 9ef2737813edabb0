"""AsyncEngine: the bridge between asyncio handlers and the synchronous `LLMEngine`.

One background thread builds the engine and is the only thread that ever calls it (the engine is
not thread-safe, and its step loop must not stall the event loop). Handlers talk to that thread
through a thread-safe inbox of add/abort commands; the thread hands each step's RequestOutputs
back to the event loop with `loop.call_soon_threadsafe`, which fans them out to per-request
asyncio queues. Everything named `_on_loop_*` runs on the event-loop thread only.

The thread may start before the event loop exists (`start()` then `attach(loop)`), so that the
CLI can build the engine, and refuse to serve with one clear line, before it binds the port.
Shutdown drains: `begin_drain()` refuses new requests, `abort_all()` ends every running one with
a final output (finish_reason "abort") that its handler still delivers."""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("ninfer.server")


class EngineDeadError(RuntimeError):
    """The engine failed (or the server is stopping); no request can be served."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading."""


class QueueFullError(RuntimeError):
    """Too many requests in flight; the client should retry later (HTTP 429)."""


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: Any
    ack: asyncio.Future


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    """Abort every request and report each one's final output (shutdown)."""


CPU_TARGET_STEP_S = 0.25   # on CPU the step budget adapts to this, so newcomers and aborts wait < 1 s


@dataclass
class StepOutput:
    output: Any          # RequestOutput
    time: float          # time.monotonic() when the step that produced it returned


class RequestStream:
    """Outputs of one request, in order; consumed by one handler on the event loop."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()

    def _on_loop_put(self, item: StepOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next_outputs(self) -> list[StepOutput]:
        """Wait for at least one output, then take everything already queued (coalescing deltas
        when the client is slower than the engine). Raises the engine's failure, if any."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        outs: list[StepOutput] = []
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            outs.append(item)
            if item.output.finished:
                self.finished = True
        return outs


class AsyncEngine:
    """Owns the engine thread. `engine_factory` builds the LLMEngine inside that thread."""

    def __init__(self, engine_factory: Callable[[], Any], *, max_in_flight: int | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self._factory = engine_factory
        self.max_in_flight = max_in_flight
        self._on_failure = on_failure
        self._inbox: queue.SimpleQueue[_Add | _Abort | _AbortAll] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._draining = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}      # loop thread only
        self._pending_acks: set[asyncio.Future] = set()   # loop thread only
        self._ready_event = threading.Event()
        self.error: BaseException | None = None
        # Filled by the engine thread once the engine exists; immutable afterwards.
        self.engine: Any = None             # for inspection only: never call it from another thread
        self.tokenizer: Any = None          # a private copy for the event loop's thread
        self.max_context: int = 0
        self.kv_capacity_tokens: int = 0
        self.kv_dtype: str = ""
        self.max_token_bytes: int = 0       # UTF-8 bytes one token stands for at most (length pre-check)
        self.startup_lines: list[str] = []
        self.last_stats: Any = None         # the latest engine.stats(), replaced whole each step

    # ------------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread (once); with `loop`, also attach the event loop."""
        if loop is not None:
            self.attach(loop)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
            self._thread.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def wait_loaded(self) -> BaseException | None:
        """Block until the engine is built or failed to build; returns the failure, if any."""
        while not self._ready_event.wait(0.1):
            if self.error is not None:
                return self.error
        return self.error

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503); running ones continue."""
        self._draining = True

    def abort_all(self) -> None:
        """End every request now; each still gets a final output (finish_reason "abort")."""
        if self.error is None:
            self._inbox.put(_AbortAll())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (blocking; call from a worker thread, not the event loop)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine thread did not stop within %.0fs", timeout)

    def fail_all_now(self) -> None:
        """On the loop, after shutdown(): wake every handler still waiting on the engine."""
        self._on_loop_fail_all(EngineDeadError("the server is shutting down"))

    @property
    def started(self) -> bool:
        """The engine finished loading at some point (it may have failed since)."""
        return self._ready_event.is_set()

    @property
    def ready(self) -> bool:
        return self._ready_event.is_set() and self.error is None

    @property
    def healthy(self) -> bool:
        return self.ready and not self._draining and self._thread is not None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        """Requests queued or running (from add_request until finished or aborted)."""
        return len(self._streams)

    # ------------------------------------------------------------------ requests (event loop)

    def check_available(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error!r}")
        if not self._ready_event.is_set():
            raise EngineNotReadyError("the engine is still loading; retry when GET /health returns 200")
        if self._stop.is_set() or self._draining:
            raise EngineDeadError("the server is shutting down")

    async def add_request(self, request_id: str, prompt: list[int], params: Any) -> RequestStream:
        """Queue a request and wait until the engine accepted it. Raises ValueError (the engine's
        own validation, e.g. too long), QueueFullError, EngineDeadError, EngineNotReadyError."""
        self.check_available()
        if self.max_in_flight is not None and self.num_in_flight >= self.max_in_flight:
            raise QueueFullError(f"server busy: {self.num_in_flight} requests in flight "
                                 f"(limit {self.max_in_flight}); retry later")
        assert self._loop is not None
        stream = RequestStream(request_id)
        ack = self._loop.create_future()
        self._pending_acks.add(ack)
        self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, prompt, params, ack))
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)   # the abort follows the add in the inbox, so it finds it
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._pending_acks.discard(ack)
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); the engine returns its pages at its next inbox drain."""
        if self._streams.pop(request_id, None) is not None and self.error is None:
            self._inbox.put(_Abort(request_id))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            engine = self._factory()
            self.engine = engine
            # The loop thread tokenizes and applies chat templates; HF fast tokenizers are not
            # safe to share across threads, so it gets its own copy.
            self.tokenizer = copy.deepcopy(engine.tokenizer)
            self.max_context = int(engine.max_context)
            self.kv_capacity_tokens = int(engine.kv_capacity_tokens)
            fmt = getattr(engine, "kv_format", None)
            self.kv_dtype = str(getattr(fmt, "name", "") or getattr(engine.config, "kv_dtype", ""))
            self.startup_lines = list(getattr(engine, "startup_lines", []) or [])
            self.max_token_bytes = max_token_bytes(self.tokenizer)
            if getattr(getattr(engine, "device", None), "type", None) == "cpu":
                engine.scheduler.set_target_step_time(CPU_TARGET_STEP_S)
            self.last_stats = engine.stats()
            self._ready_event.set()
        except BaseException as e:  # noqa: BLE001 - reported through /health and the callback
            self._fail(e, "engine failed to start", startup=True)
            return
        try:
            while not self._stop.is_set():
                busy = engine.has_unfinished_requests()
                if self._drain_inbox(engine, block=not busy):
                    self.last_stats = engine.stats()    # adds/aborts change pages and counts
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                now = time.monotonic()
                self.last_stats = engine.stats()
                if outputs:
                    self._call_on_loop(self._on_loop_dispatch, outputs, now)
            self._drain_inbox(engine, block=False)   # answer adds that raced with the stop
        except BaseException as e:  # noqa: BLE001
            self._fail(e, "engine step failed")

    def _drain_inbox(self, engine: Any, *, block: bool) -> bool:
        """Apply queued adds/aborts; True if there were any."""
        try:
            # Idle: wait for work, but wake up now and then to notice a stop request.
            cmd = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            if isinstance(cmd, _AbortAll):
                finals = [engine.abort_request(rid) for rid in list(engine.scheduler.requests)]
                self._call_on_loop(self._on_loop_dispatch, [f for f in finals if f is not None], time.monotonic())
            elif isinstance(cmd, _Add):
                if self._stop.is_set():
                    self._call_on_loop(_set_exception, cmd.ack, EngineDeadError("the server is shutting down"))
                else:
                    try:
                        engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
                        self._call_on_loop(_set_result, cmd.ack)
                    except Exception as e:  # noqa: BLE001 - rejected request, engine still fine
                        self._call_on_loop(_set_exception, cmd.ack, e)
            else:
                try:
                    engine.abort_request(cmd.request_id)
                except Exception:  # noqa: BLE001 - e.g. it finished in the meantime
                    log.debug("abort of %s failed", cmd.request_id, exc_info=True)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _fail(self, e: BaseException, what: str, startup: bool = False) -> None:
        self.error = e
        # A model that cannot load is the operator's to fix from one line (the CLI prints it);
        # the traceback is for debugging. A failure while serving is a bug: log it whole.
        log.log(logging.DEBUG if startup else logging.ERROR, "%s: %s\n%s", what, e,
                "".join(traceback.format_exception(e)))
        dead = EngineDeadError(f"{what}: {e!r}")
        self._call_on_loop(self._on_loop_fail_all, dead)
        # Commands still in the inbox will never be served: fail their waiters.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._call_on_loop(_set_exception, cmd.ack, dead)
        if self._on_failure is not None:
            try:
                self._on_failure(e)
            except Exception:  # noqa: BLE001
                log.exception("engine failure callback raised")

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:   # loop closed between the check and the call
                pass

    # ------------------------------------------------------------------ event loop side

    def _on_loop_dispatch(self, outputs: list[Any], t: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:      # aborted meanwhile
                continue
            stream._on_loop_put(StepOutput(out, t))
            if out.finished:
                del self._streams[out.request_id]

    def _on_loop_fail_all(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream._on_loop_put(err)
        self._streams.clear()
        for ack in list(self._pending_acks):
            _set_exception(ack, err)


def _set_result(fut: asyncio.Future, value: Any = None) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of input text one token can cover: the longest vocabulary
    string in UTF-8. Byte-level BPE spells each byte as one character of at most 2 UTF-8 bytes,
    SentencePiece spells a space as the 3-byte U+2581 and a fallback byte as `<0xAB>`: each token's
    string is at least as long as the text it stands for. A prompt of B bytes is therefore at least
    B / max_token_bytes tokens, which refuses an absurdly long prompt before tokenizing it."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no pre-check
        return 0
    return max((len(s.encode("utf-8", "surrogatepass")) for s in vocab), default=0)
