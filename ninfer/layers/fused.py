"""When the Triton fused-op kernels run, and how a layer imports one lazily. Layers call
`fused.use_fused_kernels(x)` through this module so a test can patch it in one place."""
from __future__ import annotations

import importlib

import torch


def lazy_kernel(module: str, name: str):
    """A fused-op kernel imported on its first call: Triton is an optional install where they never
    run (a CPU-only machine), so importing the model must not need it."""
    fn = None

    def call(*args, **kwargs):
        nonlocal fn
        if fn is None:
            fn = getattr(importlib.import_module(module), name)
        return fn(*args, **kwargs)
    call.__name__ = name
    return call


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton fused-op kernels run for tensors like x: on CUDA, for inference (they
    record no autograd graph). Tests patch this to run them on the CPU under TRITON_INTERPRET=1."""
    return x.is_cuda and not x.requires_grad
