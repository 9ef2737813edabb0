"""`ninfer-serve` as a real subprocess for tests: a free port, its output collected by a thread,
and /health awaited before the test talks to it."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from ninfer.cli import serve_main; sys.exit(serve_main())", *args]


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str
    out: list[str] = field(default_factory=list)

    @property
    def log(self) -> str:
        return "".join(self.out)


@contextlib.contextmanager
def serve_process(*args: str, timeout_s: float, env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    """Start `ninfer-serve ARGS --port P`, wait until /health answers (asserting so, with its output,
    within `timeout_s`), yield it; on exit stop what is still running and collect the rest of its output."""
    port = free_port()
    proc = subprocess.Popen(serve_cmd(*args, "--port", str(port)), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=None if env is None else {**os.environ, **env})
    srv = ServeProcess(proc, f"http://127.0.0.1:{port}")
    reader = threading.Thread(target=lambda: srv.out.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline, ok = time.monotonic() + timeout_s, False
        while time.monotonic() < deadline and proc.poll() is None and not ok:
            try:
                ok = httpx.get(f"{srv.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert ok, srv.log
        yield srv
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        reader.join(5)
