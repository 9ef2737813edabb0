"""ninfer-serve [MODEL] [flags]: an OpenAI-compatible HTTP server (also `ninfer serve`).

Engine flags are ninfer.config's (seed names, vLLM spellings as aliases); the server's own flags
follow. The engine loads on a background thread after the socket is up: GET /health answers 503
until it is ready, and the process exits non-zero if loading fails."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ninfer.config import add_engine_args, engine_config_from_args, parse_token_count
from ninfer.server.reasoning import REASONING_PARSERS
from ninfer.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from ninfer.server.async_engine import AsyncEngine

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_PENDING = 256


def _non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default %(default)s; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="default %(default)s")
    g.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every path but /health (env NINFER_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the model directory's name)")
    g.add_argument("--max-pending-requests", type=_non_negative_int, default=DEFAULT_MAX_PENDING,
                   help="requests that may wait beyond --max-concurrency; more get HTTP 429 (default %(default)s)")
    g.add_argument("--default-max-tokens", type=parse_token_count, default=None,
                   help="max_tokens when a request gives none (default: all the context the prompt leaves)")
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


def served_name(model: str | None, explicit: str | None) -> str:
    if explicit:
        return explicit
    return Path(model.rstrip("/")).name if model else "probe"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ninfer.server.app import AppSettings, create_app
    from ninfer.server.serving import ServingConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = engine_config_from_args(args)
    defaults = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                if getattr(args, k) is not None}
    name = served_name(args.model, args.served_model_name)
    serving = ServingConfig(served_model_name=name, model_path=args.model or "", no_thinking=args.no_thinking,
                            default_max_tokens=args.default_max_tokens, greedy=args.greedy,
                            sampling_defaults=defaults, kv_dtype=cfg.kv_dtype, reasoning_parser=args.reasoning_parser,
                            tool_call_parser=args.tool_call_parser)
    settings = AppSettings(api_key=args.api_key or None, max_body_bytes=args.max_body_size,
                           max_in_flight=cfg.max_num_seqs + args.max_pending_requests,
                           request_log_jsonl=args.request_log_jsonl)
    state = {"failed_at_start": False}
    server: uvicorn.Server | None = None

    def engine_factory() -> Any:
        from ninfer.engine.engine import LLMEngine
        return LLMEngine(cfg)

    def on_ready(engine: AsyncEngine) -> None:
        # The engine logs these at INFO; print them when that logging is not shown, never twice.
        if not logging.getLogger("ninfer.engine").isEnabledFor(logging.INFO):
            for line in engine.startup_lines:
                print(line, flush=True)
        print(f"ninfer-serve: model {name!r} ready on http://{args.host}:{args.port} "
              f"(max_model_len={engine.max_context}, kv capacity {engine.kv_capacity_tokens} tokens, "
              f"api key {'required' if settings.api_key else 'off'})", flush=True)

    def on_failure(err: BaseException) -> None:
        if server is not None and not app.state.engine.started:
            state["failed_at_start"] = True
            print(f"ninfer-serve: the engine failed to start: {err}", file=sys.stderr, flush=True)
            server.should_exit = True

    app = create_app(engine_factory, serving, settings, on_engine_ready=on_ready, on_engine_failure=on_failure)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    return 1 if state["failed_at_start"] else 0
