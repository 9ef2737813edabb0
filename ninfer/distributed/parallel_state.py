"""The tensor-parallel group of this process, and the collectives the layers call.

Single-process runs never initialise a group: `tp_size()` is 1 and every collective is the
identity, so the layers carry no `if tp` branches. Model construction reads `tp_size()` /
`tp_rank()` (like vLLM's parallel state), so the group must be set up before the model is built."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_RANK = 0
_SIZE = 1
DEFAULT_TIMEOUT_S = float(os.environ.get("NINFER_TP_TIMEOUT_S", "300"))


def init_tp(rank: int, world_size: int, init_method: str, *, backend: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None) -> None:
    """Join the group (`init_method` e.g. 'tcp://127.0.0.1:PORT'). NCCL when `device` is CUDA, else gloo.
    The timeout bounds init and every collective, so a dead rank stops the group instead of hanging it."""
    global _RANK, _SIZE
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank {rank} is not in 0..{world_size - 1}")
    if world_size > 1:
        if backend is None:
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        kw = {"device_id": device} if backend == "nccl" and device is not None else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kw)
    _RANK, _SIZE = rank, world_size


def destroy_tp() -> None:
    global _RANK, _SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE = 0, 1


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _SIZE


def is_driver() -> bool:
    """Rank 0 runs the scheduler, the sampler and the server; the others follow."""
    return _RANK == 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (the result of a row-parallel linear)."""
    if _SIZE > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (vocab-parallel logits)."""
    if _SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: object = None, src: int = 0) -> object:
    """Rank `src`'s Python object on every rank (the scheduled step, for followers)."""
    if _SIZE == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
