"""Pieces shared by the quantized-weight GEMMs (fp8_gemm.py, nvfp4_gemm.py): argument checks that
fail with one line, the split-K choice for decode batches, and the split-K reduction."""
from __future__ import annotations

import os

import torch
import triton

from ninfer.kernels._common import SM_COUNT

ACT_DTYPES = (torch.bfloat16, torch.float16)
DECODE_M = 16  # up to this many rows a GEMM is memory-bound: one 16-row MMA tile, split over K


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 elsewhere (the interpreter), so small tests still split K."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in SM_COUNT:
        SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return SM_COUNT[idx]


def check_common(op: str, x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x as a 2-D [M, K] view (leading dims flattened); one-line errors for a wrong dtype or shape."""
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"{op}: x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: x's last dim must be K={k} (the weight's), got x {list(x.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias must be [N={n}], got {list(bias.shape)}")
    if bias is not None and bias.device != x.device:
        raise ValueError(f"{op}: bias is on {bias.device}, x on {x.device}")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def check_device(op: str, x: torch.Tensor, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device != x.device:
            raise ValueError(f"{op}: every tensor must be on x's device {x.device}, got one on {t.device}")


def split_k(device: torch.device, n_tiles: int, k_blocks: int) -> tuple[int, int]:
    """(splits, K blocks per split) for a decode GEMM: enough programs to keep every SM reading
    (~2 per SM); each split keeps at least 2 K blocks so the partial sums stay a small fraction of
    the weight bytes."""
    want = triton.cdiv(2 * sm_count(device), max(n_tiles, 1))
    split = max(1, min(want, k_blocks // 2 if k_blocks >= 4 else 1))
    per = triton.cdiv(k_blocks, split)
    return triton.cdiv(k_blocks, per), per


def reduce_splits(partial: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, ...],
                  dtype: torch.dtype) -> torch.Tensor:
    """The fp32 split-K partials [S, M, N] summed (in a fixed order: deterministic), bias added in
    fp32, rounded once to the activation dtype."""
    acc = partial.sum(0) if partial.shape[0] > 1 else partial[0]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(dtype).reshape(shape)
