"""The driver's side of tensor parallelism: the follower processes, their startup, their steps,
their faults and their end.

`WorkerGroup(n, devices, threads)` spawns ranks 1..n-1 (torch.multiprocessing, spawn context), each
running `ninfer.distributed.worker.worker_main` with one pipe to the driver; the driver is rank 0
in this process. Every phase of the startup is a message a follower sends on its pipe (see
worker.py), awaited while watching every follower's process: one that exits, or reports an error,
stops the startup at once with one line naming its rank; one that says nothing within the timeout
(parallel_state.DEFAULT_TIMEOUT_S, env NINFER_TP_TIMEOUT_S) does too. The rendezvous itself
(init_tp) runs on a side thread so that the driver can watch while it waits.

Steps go over the same pipes: the driver pickles the step message once and writes the bytes to
each follower (cheaper than a gloo broadcast; see docs/ENGINE.md), and a follower waits on its
pipe without a timeout, so an idle server keeps its group. Before each step the driver polls the
followers (exit status, error reports); a follower that died mid-step breaks the step's
collectives (gloo reports the closed connection; on NCCL a watcher thread aborts the group), and
the step is reported as that rank's death. `close()` tells the followers to exit, waits, and
kills what is left; it also runs when the group is garbage-collected or the interpreter exits,
and the followers exit on their own if the driver process disappears."""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait as mp_wait
from typing import Any

import torch

from ninfer.distributed import parallel_state as ps
from ninfer.distributed.worker import worker_main
from ninfer.kvcache.memory import DeviceMemory

log = logging.getLogger("ninfer.distributed")
WORKER_ENTRY = worker_main     # the followers' entry point (importable: the spawn context pickles it)
EXIT_WAIT_S = 10.0             # how long close() lets the followers exit before killing them
_ACTIVE: list[weakref.ref] = []  # the group of this process (one default process group at a time)


class TensorParallelError(RuntimeError):
    """The group cannot start or went down: which rank, and why, in one line."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "is not answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class WorkerGroup:
    def __init__(self, world_size: int, devices: list[torch.device], threads: int,
                 timeout_s: float | None = None) -> None:
        if any(g is not None and not g._closed.is_set() for g in (r() for r in _ACTIVE)):
            raise TensorParallelError("a tensor-parallel engine already runs in this process; "
                                      "shut it down first (LLM.close() / engine.shutdown())")
        self.world_size = world_size
        self.devices = devices
        self.timeout_s = float(ps.DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        self.backend = "nccl" if devices[0].type == "cuda" else "gloo"
        self.failure: str | None = None        # the first fault seen, one line
        self._closed = threading.Event()
        self._errors: dict[int, str] = {}           # rank -> its error report
        self._inbox: dict[int, dict[str, Any]] = {}  # rank -> startup messages not yet awaited
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off; the followers inherit it
        ctx = torch.multiprocessing.get_context("spawn")
        init = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._finalizer = weakref.finalize(self, _close, self.procs, self.conns, self._closed)
        # Before multiprocessing's own exit hook (atexit runs last-registered first), which would
        # only terminate the followers: they get their exit message and the group is left cleanly.
        atexit.register(self._finalizer)
        _ACTIVE[:] = [weakref.ref(self)]
        try:
            self._start(ctx, init, threads)
        except BaseException:
            self.close()
            raise

    def _start(self, ctx: Any, init: str, threads: int) -> None:
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=WORKER_ENTRY, name=f"ninfer-tp{rank}", daemon=True,
                            args=(rank, self.world_size, init, str(self.devices[rank]), threads, self.timeout_s,
                                  os.getpid(), child))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.memories: list[DeviceMemory] = self._gather("up", "start")   # each follower's device
        self._init_driver(init)
        threading.Thread(target=_watch, args=([p.sentinel for p in self.procs], self._closed, self.backend),
                         daemon=True, name="ninfer-tp-watch").start()

    # -- startup ------------------------------------------------------------------------------------
    def _init_driver(self, init: str) -> None:
        err: list[BaseException] = []

        def join() -> None:
            try:
                ps.init_tp(0, self.world_size, init, timeout_s=self.timeout_s, device=self.devices[0])
            except BaseException as e:  # noqa: BLE001 - re-raised on the driver's thread
                err.append(e)

        t = threading.Thread(target=join, daemon=True, name="ninfer-tp-init")
        t.start()
        deadline = time.monotonic() + self.timeout_s
        while t.is_alive():
            t.join(0.05)
            self.check("form the group")
            if time.monotonic() > deadline:
                raise self._fail(f"the tensor-parallel group did not form within {self.timeout_s:.0f}s "
                                 f"(NINFER_TP_TIMEOUT_S)")
        if err:
            raise self._fail(f"the tensor-parallel group did not form: {err[0]}")

    def _gather(self, kind: str, what: str) -> list[Any]:
        """Wait until every follower sent `kind`; their payloads in rank order."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < len(self.conns):
            left = deadline - time.monotonic()
            if left <= 0:
                late = [r for r in range(1, self.world_size) if r not in got]
                raise self._fail(f"tensor-parallel rank {late[0]} did not {what} within {self.timeout_s:.0f}s "
                                 f"(NINFER_TP_TIMEOUT_S)")
            pending = [c for r, c in enumerate(self.conns, 1) if r not in got]
            mp_wait(pending + [p.sentinel for p in self.procs], timeout=min(left, 1.0))
            for rank, conn in enumerate(self.conns, 1):
                self._poll(rank, conn)
                if rank not in got and kind in self._inbox.get(rank, {}):
                    got[rank] = self._inbox[rank].pop(kind)
            self.check(what)
        return [got[r] for r in range(1, self.world_size)]

    def _poll(self, rank: int, conn: Any) -> None:
        """Read what `rank` sent: errors are kept for check(), startup messages for _gather()."""
        try:
            while conn.poll():
                kind, payload = conn.recv()
                if kind == "error":
                    self._errors.setdefault(rank, payload)
                elif kind == "trace":
                    log.debug("tensor-parallel rank %d:\n%s", rank, payload)
                else:
                    self._inbox.setdefault(rank, {})[kind] = payload
        except (EOFError, OSError):
            pass

    def send(self, kind: str, payload: Any = None) -> None:
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self._poll(rank, conn)
                raise self._fail(self._rank_down(rank, "a step" if kind == "step" else f"startup ({kind})")) from None

    def setup(self, setup: Any) -> None:
        self.send("setup", setup)

    def wait_loaded(self) -> None:
        self._gather("loaded", "load the model")
        self.send("go")

    def wait_ready(self) -> None:
        self._gather("ready", "capture CUDA graphs")

    def digests(self) -> list[str]:
        """Each follower's `ninfer.engine.rank.pool_digest`, in rank order."""
        self.check()
        self.send("digest")
        return self._gather("digest", "hash its KV pool")

    # -- faults -------------------------------------------------------------------------------------
    def _rank_down(self, rank: int, during: str) -> str:
        p = self.procs[rank - 1]
        p.join(0.2)   # a follower that reported an error is about to exit
        self._poll(rank, self.conns[rank - 1])   # what it sent just before it went
        err = self._errors.get(rank)
        if err:
            return f"tensor-parallel rank {rank} failed: {err}"
        return f"tensor-parallel rank {rank} (pid {p.pid}) {_exit_reason(p.exitcode)} during {during}"

    def _fail(self, message: str) -> TensorParallelError:
        if self.failure is None:
            self.failure = message
            log.error("%s; stopping the group", message)
        self.close()
        return TensorParallelError(self.failure)

    def check(self, during: str = "a step") -> None:
        """Raise TensorParallelError if a follower reported an error or exited."""
        if self.failure is not None or self._closed.is_set():
            raise TensorParallelError(self.failure or "the tensor-parallel group was shut down")
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), 1):
            self._poll(rank, conn)
            if rank in self._errors or p.exitcode is not None:
                raise self._fail(self._rank_down(rank, during))

    def step_failed(self, e: BaseException) -> TensorParallelError | None:
        """After a step raised: the follower's death that explains it, if any (waits a moment for it)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check()
            except TensorParallelError as err:
                return err
            time.sleep(0.05)
        return None

    # -- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        self._finalizer()


def _watch(sentinels: list[int], closed: threading.Event, backend: str) -> None:
    """A follower's death while the driver blocks inside an NCCL collective would hang it until the
    collective timeout: abort the group instead, so the step raises and check() names the rank.
    (gloo reports the closed connection by itself.) Holds no reference to the group."""
    mp_wait(sentinels)
    if closed.is_set() or backend != "nccl":
        return
    log.error("a tensor-parallel rank exited; aborting the group's collectives")
    try:
        torch.distributed.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - best effort: the collective timeout remains
        log.debug("could not abort the process group", exc_info=True)


def _close(procs: list[Any], conns: list[Any], closed: threading.Event) -> None:
    """Tell the followers to exit, wait EXIT_WAIT_S, kill what is left, leave the group. Runs once:
    from close(), when the group is collected, or at interpreter exit."""
    closed.set()
    data = pickle.dumps(("exit", None))
    for conn in conns:
        try:
            conn.send_bytes(data)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + EXIT_WAIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for conn in conns:
        conn.close()
    try:
        ps.destroy_tp()
    except Exception:  # noqa: BLE001 - a group aborted after a follower's death may refuse; leave anyway
        log.debug("leaving the process group failed", exc_info=True)
        ps._RANK, ps._SIZE = 0, 1
