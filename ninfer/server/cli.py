"""ninfer-serve [MODEL] [flags]: an OpenAI-compatible HTTP server (also `ninfer serve`).

Engine flags are ninfer.config's (seed names, vLLM spellings as aliases); the server's own flags
follow. Everything is checked before the port is bound: the flags (a bad one is one line and exit
status 2), then the address (free and bindable), then the engine itself is built (a model that
cannot load, a KV format that does not exist or a context that does not fit is one line and exit
status 1). Only then does uvicorn listen. SIGTERM or SIGINT drain (see app.DrainingServer) and
exit 0."""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ninfer.config import add_engine_args, engine_config_from_args, parse_token_count
from ninfer.server.reasoning import REASONING_PARSERS
from ninfer.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from ninfer.server.async_engine import AsyncEngine

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_PENDING = 256
DEFAULT_MAX_TOKENS = 8192
DEFAULT_SHUTDOWN_TIMEOUT = 10.0
log = logging.getLogger("ninfer.server")


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {v}")
    return v


def _host(text: str) -> str:
    try:
        socket.getaddrinfo(text, None, flags=socket.AI_NUMERICHOST)
        return text
    except socket.gaierror:
        pass
    if re.fullmatch(r"[\d.]+", text) or ":" in text:   # a malformed literal: never ask DNS about it
        raise argparse.ArgumentTypeError(f"not a valid IP address: {text!r}")
    try:
        socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot resolve host {text!r}: {e}") from None
    return text


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds: {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    # argparse's own error prints the whole usage block first (dozens of flags): keep it to one line.
    p.error = lambda message: _die(f"{p.prog}: error: {message} (see --help)", 2)  # type: ignore[method-assign]
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", type=_host, default=DEFAULT_HOST,
                   help="address to bind (default %(default)s; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=_port, default=DEFAULT_PORT, help="default %(default)s")
    g.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every path but /health (env NINFER_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the model directory's name)")
    g.add_argument("--max-pending-requests", type=_non_negative_int, default=DEFAULT_MAX_PENDING,
                   help="requests that may wait beyond --max-concurrency; more get HTTP 429 (default %(default)s)")
    g.add_argument("--max-tokens-default", "--default-max-tokens", dest="max_tokens_default",
                   type=parse_token_count, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens of a request that gives none, at most what the context leaves (default %(default)s)")
    g.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, let running requests finish this long, then abort them with a "
                        "final event (default %(default)s)")
    g.add_argument("--no-thinking", action="store_true",
                   help="render chat templates with enable_thinking=False (where the template has it)")
    g.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *REASONING_PARSERS],
                   help="split <think> blocks into reasoning_content: auto = when the chat template has "
                        "</think>; none = leave them in content (default %(default)s)")
    g.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *TOOL_PARSERS],
                   help="parse the model's tool calls into tool_calls: auto = picked from the chat template "
                        "when only one format fits (default %(default)s)")
    g.add_argument("--greedy", action="store_true", help="decode every request greedily (temperature 0, overriding requests)")
    g.add_argument("--max-body-size", type=parse_token_count, default=64 << 20, metavar="BYTES",
                   help="largest request body; larger gets HTTP 413 (default 64M = 64 MiB)")
    g.add_argument("--request-log-jsonl", default=None, metavar="FILE",
                   help="append one JSON event per request (sizes, timings, status; no prompt text, no key)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="access_log",
                   action="store_false", help="no per-request uvicorn access lines")
    s = p.add_argument_group("sampling defaults (used when a request omits the field)")
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)


def _die(message: str, status: int) -> NoReturn:
    print(message, file=sys.stderr, flush=True)
    sys.exit(status)


def served_name(model: str | None, explicit: str | None) -> str:
    if explicit:
        return explicit
    return Path(model.rstrip("/")).name if model else "probe"


def _check_bindable(host: str, port: int) -> None:
    """Bind and release the address now, so a taken port is reported before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            _die(f"ninfer-serve: error: cannot listen on {host}:{port}: {e.strerror or e}", 1)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ninfer.engine.sampling import SamplingParams
    from ninfer.server.app import AppSettings, DrainingServer, create_app
    from ninfer.server.serving import ServingConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = engine_config_from_args(args)
    defaults = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                if getattr(args, k) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        _die(f"ninfer-serve: error: bad sampling default: {e}", 2)
    _check_bindable(args.host, args.port)
    name = served_name(args.model, args.served_model_name)
    serving = ServingConfig(served_model_name=name, model_path=args.model or "", no_thinking=args.no_thinking,
                            default_max_tokens=args.max_tokens_default, greedy=args.greedy,
                            sampling_defaults=defaults, kv_dtype=cfg.kv_dtype, reasoning_parser=args.reasoning_parser,
                            tool_call_parser=args.tool_call_parser)
    settings = AppSettings(api_key=args.api_key or None, max_body_bytes=args.max_body_size,
                           max_in_flight=cfg.max_num_seqs + args.max_pending_requests,
                           request_log_jsonl=args.request_log_jsonl)

    def engine_factory() -> Any:
        from ninfer.engine.engine import LLMEngine
        return LLMEngine(cfg, progress=sys.stderr.isatty())   # no bar in logs

    def on_ready(engine: AsyncEngine) -> None:
        # The engine logs these at INFO; print them when that logging is not shown, never twice.
        if not logging.getLogger("ninfer.engine").isEnabledFor(logging.INFO):
            for line in engine.startup_lines:
                print(line, flush=True)
        print(f"ninfer-serve: model {name!r} ready on http://{args.host}:{args.port} "
              f"(max_model_len={engine.max_context}, kv capacity {engine.kv_capacity_tokens} tokens, "
              f"api key {'required' if settings.api_key else 'off'})", flush=True)

    app = create_app(engine_factory, serving, settings, on_engine_ready=on_ready)
    aengine: AsyncEngine = app.state.engine
    aengine.start()          # builds the engine on its own thread; nothing listens yet
    try:
        err = aengine.wait_loaded()
    except KeyboardInterrupt:
        return 130
    if err is not None:
        log.debug("engine failed to start", exc_info=err)
        _die(f"ninfer-serve: error: the engine failed to start: {type(err).__name__}: {err}", 1)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log)
    server = DrainingServer(config, aengine, args.shutdown_timeout)
    # uvicorn re-raises the signal it drained on once it is done; a handler that ignores it makes
    # that re-raise a no-op, so a drained shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0
