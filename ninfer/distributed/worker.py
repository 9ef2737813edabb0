"""A follower rank: its own process (spawned by `WorkerGroup`), its own device, the same forward as
the driver each step. It never schedules or samples: it replays the steps the driver sends.

Conversation with the driver over a pipe (`conn`), in order:
    -> ("up", DeviceMemory)          device bound; then init_tp (the driver's rendezvous)
    <- ("setup", RankSetup)          the driver's plan
    -> ("loaded", None)              model, pool, backend, runner built
    <- ("go", None)                  every rank loaded: calibrate the key centring, capture the decode
                                     graphs (both run collectives)
    -> ("ready", None)
    <- ("step", message) ...         see step_message; ("exit", None) ends it
    <- ("digest", None) -> ("digest", hash of the KV pool)   the lock-step check
Any failure is sent as ("error", one line) before the process exits with status 1. A closed pipe
(the driver is gone) or a new parent process id ends the follower too: it never outlives the driver.
SIGINT is ignored (the driver ends its followers)."""
from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from typing import Any

PARENT_POLL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    """Exit when the driver died without closing the pipe cleanly (e.g. SIGKILL while a collective
    blocks this process): the orphan is re-parented, so its parent id changes."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            _quit(3)


def _quit(code: int) -> None:
    """Exit now, skipping the interpreter's slow teardown of torch, but release what
    multiprocessing registered (a library's semaphore would otherwise be reported as leaked)."""
    from multiprocessing import util
    try:
        util._run_finalizers(0)
        util._run_finalizers()
    finally:
        os._exit(code)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def worker_main(rank: int, world_size: int, init_method: str, device: str, threads: int,
                timeout_s: float, parent_pid: int, conn: Any) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (before NCCL starts)
    # The driver decides when a follower ends: a Ctrl-C in the terminal reaches the whole process
    # group, and must not kill the follower while the driver drains its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="ninfer-parent-watch").start()
    stage = "start"
    try:
        import torch

        from ninfer.distributed import parallel_state as ps
        from ninfer.kvcache.memory import device_memory

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        torch.set_num_threads(threads)
        conn.send(("up", device_memory(dev)))
        stage = "join the group"
        ps.init_tp(rank, world_size, init_method, timeout_s=timeout_s, device=dev)
        stage = "receive the plan"
        kind, setup = conn.recv()
        if kind != "setup":
            _quit(0)
        stage = "load the model"
        from ninfer.engine.rank import build_rank, capture_graphs, centre_keys
        parts = build_rank(setup, dev)
        conn.send(("loaded", None))
        kind, _ = conn.recv()
        if kind != "go":
            _quit(0)
        stage = "calibrate the key centring"
        centre_keys(parts, setup, dev)
        stage = "capture CUDA graphs"
        capture_graphs(parts.runner, setup.config)
        conn.send(("ready", None))
        stage = "run a step"
        _serve(parts.runner, conn)
        _quit(0)   # nothing to flush; the interpreter's teardown of torch would only delay close()
    except EOFError:
        _quit(0)   # the driver closed the pipe: it is gone, and so may be the group
    except BaseException as e:  # noqa: BLE001 - reported to the driver as one line, then exit 1
        try:
            conn.send(("error", f"could not {stage}: {_one_line(e)}"))
            conn.send(("trace", "".join(traceback.format_exception(e))))
        except (OSError, ValueError):
            pass
        _quit(1)


def _serve(runner: Any, conn: Any) -> None:
    import torch

    from ninfer.distributed.step_message import StepDecoder
    decoder = StepDecoder()
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "exit":
            return
        if kind == "digest":
            from ninfer.engine.rank import pool_digest
            conn.send(("digest", pool_digest(runner.backend.pool)))
            continue
        batch = decoder.decode(payload)
        if not batch.requests:
            continue
        try:
            with torch.inference_mode():
                runner.execute(batch)
        except ValueError:
            # The KV formats refuse NaN/Inf K/V with ValueError; the driver hits the same refusal
            # and fails the batch's requests, which the next message drops here.
            pass

