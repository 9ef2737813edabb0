"""How to send the step to the followers: measured, not assumed.

    python -m ninfer.distributed.transport_bench [--requests 64] [--steps 2000]

One spawned follower on CPU; per step the driver sends a decode step of `--requests` requests (one
new token each, a page appended to every 8th table, as StepEncoder makes them) and the follower
decodes it, three ways: the pickled message over a pipe (what WorkerGroup does); gloo
`broadcast_object_list` (parallel_state.broadcast_object); gloo tensor broadcasts of a compact
int64 encoding (a length, then the payload). Prints microseconds per step, the follower keeping
up (it acknowledges the last step only)."""
from __future__ import annotations

import argparse
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist

from ninfer.distributed.group import free_port


def _message(b: int, step: int) -> tuple[list[int], list[tuple]]:
    return [], [(k, 1000 + step, 1, [17 + k], 1 if (k + step) % 8 == 0 else 0,
                 [5000 + k] if (k + step) % 8 == 0 else [], -1) for k in range(b)]


def _encode(msg: tuple[list[int], list[tuple]]) -> torch.Tensor:
    drop, entries = msg
    out = [len(drop), *drop, len(entries)]
    for key, c, n, toks, kind, ids, slot in entries:
        out += [key, c, n, kind, slot, len(toks), *toks, len(ids), *ids]
    return torch.from_numpy(np.asarray(out, dtype=np.int64))


def _decode(t: torch.Tensor) -> tuple[list[int], list[tuple]]:
    v = t.tolist()
    nd = v[0]
    drop, i = v[1:1 + nd], 1 + nd
    entries = []
    for _ in range(v[i]):
        key, c, n, kind, slot, nt = v[i + 1:i + 7]
        toks = v[i + 7:i + 7 + nt]
        j = i + 7 + nt
        ids = v[j + 1:j + 1 + v[j]]
        entries.append((key, c, n, toks, kind, ids, slot))
        i = j + v[j]
    return drop, entries


def _follower(init: str, b: int, steps: int, conn) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=1, world_size=2)
    for _ in range(steps):
        pickle.loads(conn.recv_bytes())
    conn.send("ack")
    for _ in range(steps):
        box = [None]
        dist.broadcast_object_list(box, src=0)
    conn.send("ack")
    n = torch.zeros(1, dtype=torch.int64)
    for _ in range(steps):
        dist.broadcast(n, src=0)
        buf = torch.empty(int(n), dtype=torch.int64)
        dist.broadcast(buf, src=0)
        _decode(buf)
    conn.send("ack")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    b, steps = args.requests, args.steps
    ctx = torch.multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    init = f"tcp://127.0.0.1:{free_port()}"
    p = ctx.Process(target=_follower, args=(init, b, steps, child), daemon=True)
    p.start()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=2)
    msgs = [_message(b, s) for s in range(steps)]
    size = len(pickle.dumps(msgs[0], protocol=pickle.HIGHEST_PROTOCOL))
    res = {}
    t0 = time.perf_counter()
    for m in msgs:
        parent.send_bytes(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))
    parent.recv()
    res["pipe, pickled object"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for m in msgs:
        dist.broadcast_object_list([m], src=0)
    parent.recv()
    res["gloo broadcast_object_list"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for m in msgs:
        t = _encode(m)
        dist.broadcast(torch.tensor([t.numel()], dtype=torch.int64), src=0)
        dist.broadcast(t, src=0)
    parent.recv()
    res["gloo tensors (length + int64 payload)"] = time.perf_counter() - t0
    p.join(30)
    dist.destroy_process_group()
    print(f"decode step of {b} requests ({size} bytes pickled), {steps} steps, torch {torch.__version__}")
    for name, sec in res.items():
        print(f"  {name:40s} {sec / steps * 1e6:8.1f} us/step")


if __name__ == "__main__":
    main()
