"""The attention backend, chosen once at startup: which implementation serves each op.

Ops and their callables (what a bound implementation is called with):
  store    fn(k [T, Hkv, D], v, planes, slot_mapping [T]) -> None        (writes the layer's planes)
  decode   fn(q [B, Hq, D], planes, block_tables, seq_lens, scale, num_splits[, tail]) -> out [B, Hq, D]
  prefill  fn(q [T, Hq, D], planes, meta, scale[, window]) -> out [T, Hq, D] (planes already hold the chunk)
(``tail`` / ``window``: a windowed format's ring, see triton_backend.py; only implementations that
declare windowed formats get them.)
``planes`` is the pool's per-layer dict. ``OP_IMPLS[op]`` lists the implementations in order of
preference, each declaring the formats it has kernels for (``formats``: kernel codes); the first
that declares the format, whose ``unsupported(ctx)`` is None and whose ``bind(ctx)`` succeeds (it may
build and load kernels, so a broken compiler is found here, not mid-serving) serves the op. Adding
an implementation (a new prefill, say) = one ``OpImpl`` passed to ``register_op``.

``select_backend(pool, device, dtype, num_heads)`` returns the CPU reference backend on CPU, else
a ``KernelAttentionBackend`` with the bound ops; its ``kernel_paths()`` line says what serves each
op and why a preferred one does not, e.g. ``store=cuda decode=triton (head_dim 64: CUDA path
needs 128 or 256) prefill=triton``. A format no implementation of an op supports is refused with
every reason (``UnsupportedAttention``). Tests and benches force an implementation with
``force={"decode": "triton"}`` (or ``kind="reference"`` / ``"kernels"``), never an env variable.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ninfer.kvcache.formats import KERNEL_E8, KERNEL_INT8, KERNEL_PLAIN, KERNEL_RK4, KVFormat

OPS = ("store", "decode", "prefill")
_ALL = frozenset({KERNEL_PLAIN, KERNEL_INT8, KERNEL_RK4, KERNEL_E8})  # the built-in formats' kernel codes


class UnsupportedAttention(ValueError):
    """No implementation serves an op for this format, device and geometry."""


@dataclass(frozen=True)
class OpContext:
    fmt: KVFormat
    device: torch.device
    dtype: torch.dtype            # q / K / V dtype (the model dtype)
    head_dim: int
    num_heads: int | None         # None: unknown (the GQA limits are then checked per call)
    num_kv_heads: int
    page_size: int


@dataclass(frozen=True)
class OpImpl:
    op: str                                                    # "store" | "decode" | "prefill"
    name: str                                                  # "cuda", "triton", ...
    unsupported: Callable[[OpContext], str | None]             # None = can serve ctx
    bind: Callable[[OpContext], Callable]                      # the op callable for ctx
    formats: frozenset[int] | None = None                      # kernel codes it has kernels for (None: any)
    num_splits: Callable[[OpContext, int, int], int] | None = None  # decode: (batch, table width) -> splits

    def refuses(self, ctx: OpContext) -> str | None:
        """Why this implementation cannot serve ctx (its declared formats first, then the geometry)."""
        if self.formats is not None and ctx.fmt.kernel_code not in self.formats:
            return f"format {ctx.fmt.name} has no {self.name} {self.op} kernel"
        return self.unsupported(ctx)


@dataclass(frozen=True)
class BoundOp:
    impl: OpImpl
    fn: Callable
    note: str                    # why preferred implementations were passed over ("" if none)

    @property
    def line(self) -> str:
        return f"{self.impl.op}={self.impl.name}" + (f" ({self.note})" if self.note else "")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_unsupported(ctx: OpContext) -> str | None:
    if ctx.device.type != "cuda" and not (ctx.device.type == "cpu" and _interpreting()):
        return f"Triton needs CUDA (or TRITON_INTERPRET=1 on CPU), device is {ctx.device}"
    if ctx.page_size < 16 or ctx.page_size & (ctx.page_size - 1):
        return f"page size {ctx.page_size} (Triton kernels: a power of 2 >= 16)"
    return None


def _triton_prefill_unsupported(ctx: OpContext) -> str | None:
    if ctx.fmt.window:  # the chunk must see its own fresh K/V and the ring: the SDPA path does that
        return f"format {ctx.fmt.name} has a window ring (served by the SDPA prefill)"
    why = _triton_unsupported(ctx)
    d = ctx.head_dim
    if why is None and ctx.fmt.rotated and (d < 64 or d & (d - 1)):
        why = f"head_dim {d} (rotated formats: a power of 2 >= 64)"
    return why


# ------------------------------------------------------------------ the built-in implementations
def _store_triton(ctx: OpContext) -> Callable:
    from ninfer.kernels.store_kv import store_kv_triton
    return functools.partial(_store_call, store_kv_triton, ctx.fmt)


def _store_cuda_unsupported(ctx: OpContext) -> str | None:
    from ninfer.kernels.store_kv_cuda import cuda_store_unsupported
    return cuda_store_unsupported(ctx.fmt, ctx.device, ctx.dtype, ctx.head_dim)


def _store_cuda(ctx: OpContext) -> Callable:
    from ninfer.kernels.store_kv_cuda import load_store_cuda, store_kv_cuda
    load_store_cuda(ctx.fmt, ctx.device, ctx.dtype)
    return functools.partial(_store_call, store_kv_cuda, ctx.fmt)


def _store_call(kernel, fmt, k, v, planes, slot_mapping) -> None:
    kernel(k, v, planes, slot_mapping, fmt)


def _decode_triton(ctx: OpContext) -> Callable:
    from ninfer.kernels.paged_decode import paged_decode_triton
    return functools.partial(_decode_call, paged_decode_triton, ctx.fmt)


def _decode_triton_splits(ctx: OpContext, batch: int, width: int) -> int:
    from ninfer.kernels.paged_decode import default_num_splits
    return default_num_splits(batch, ctx.num_kv_heads, width, ctx.device)


def _decode_cuda_unsupported(ctx: OpContext) -> str | None:
    from ninfer.kernels.paged_decode_cuda import cuda_decode_unsupported
    heads = ctx.num_heads if ctx.num_heads is not None else ctx.num_kv_heads
    return cuda_decode_unsupported(ctx.fmt, ctx.device, ctx.dtype, ctx.head_dim, heads, ctx.num_kv_heads,
                                   ctx.page_size)


def _decode_cuda(ctx: OpContext) -> Callable:
    from ninfer.kernels.paged_decode import paged_decode_cuda
    from ninfer.kernels.paged_decode_cuda import load_decode_cuda
    load_decode_cuda(ctx.fmt, ctx.head_dim, ctx.device, ctx.dtype)
    return functools.partial(_decode_call, paged_decode_cuda, ctx.fmt)


def _decode_cuda_splits(ctx: OpContext, batch: int, width: int) -> int:
    from ninfer.kernels.paged_decode_cuda import cuda_num_splits
    return cuda_num_splits(batch, ctx.num_kv_heads, width, ctx.device, ctx.fmt, ctx.head_dim, ctx.dtype)


def _decode_call(kernel, fmt, q, planes, block_tables, seq_lens, scale, num_splits, tail=None):
    return kernel(q, planes, planes, block_tables, seq_lens, fmt, scale, num_splits=num_splits, tail=tail)


def _prefill_triton(ctx: OpContext) -> Callable:
    from ninfer.kernels.prefill import paged_prefill_triton

    fmt = ctx.fmt

    def prefill(q, planes, meta, scale):
        return paged_prefill_triton(q, planes, planes, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                    meta.max_query_len, fmt, scale)
    return prefill


def _prefill_sdpa_unsupported(ctx: OpContext) -> str | None:
    from ninfer.attention.prefill_sdpa import sdpa_prefill_unsupported
    return sdpa_prefill_unsupported(ctx)


def _prefill_sdpa(ctx: OpContext) -> Callable:
    from ninfer.attention.prefill_sdpa import bind_sdpa_prefill
    return bind_sdpa_prefill(ctx, None if _triton_prefill_unsupported(ctx) else _prefill_triton(ctx))


OP_IMPLS: dict[str, list[OpImpl]] = {
    "store": [OpImpl("store", "cuda", _store_cuda_unsupported, _store_cuda,
                     frozenset({KERNEL_RK4, KERNEL_E8})),
              OpImpl("store", "triton", _triton_unsupported, _store_triton, _ALL)],
    "decode": [OpImpl("decode", "cuda", _decode_cuda_unsupported, _decode_cuda,
                      frozenset({KERNEL_INT8, KERNEL_RK4, KERNEL_E8}), _decode_cuda_splits),
               OpImpl("decode", "triton", _triton_unsupported, _decode_triton, _ALL, _decode_triton_splits)],
    "prefill": [OpImpl("prefill", "sdpa", _prefill_sdpa_unsupported, _prefill_sdpa, _ALL),
                OpImpl("prefill", "triton", _triton_prefill_unsupported, _prefill_triton, _ALL)],
}


def register_op(impl: OpImpl, *, first: bool = True) -> None:
    """Add an implementation of an op, preferred over the others (``first``) or after them;
    one with the same (op, name) is replaced."""
    if impl.op not in OP_IMPLS:
        raise ValueError(f"unknown attention op {impl.op!r}; ops: {', '.join(OPS)}")
    if impl.op == "decode" and impl.num_splits is None:
        raise ValueError("a decode implementation needs num_splits")
    impls = [i for i in OP_IMPLS[impl.op] if i.name != impl.name]
    OP_IMPLS[impl.op] = [impl, *impls] if first else [*impls, impl]


def select_ops(ctx: OpContext, force: Mapping[str, str] | None = None) -> dict[str, BoundOp]:
    """Bind every op to the first implementation that serves ctx (or the forced one)."""
    force = dict(force or {})
    unknown = set(force) - set(OPS)
    if unknown:
        raise ValueError(f"unknown attention op(s) {sorted(unknown)}; ops: {', '.join(OPS)}")
    chosen: dict[str, BoundOp] = {}
    for op in OPS:
        impls = OP_IMPLS[op]
        if op in force:
            impls = [i for i in impls if i.name == force[op]]
            if not impls:
                raise ValueError(f"attention: no {op} implementation named {force[op]!r}; "
                                 f"have {', '.join(i.name for i in OP_IMPLS[op])}")
        skipped: list[tuple[str, str]] = []  # (implementation, why it does not serve ctx)
        for impl in impls:
            why = impl.refuses(ctx)
            if why is None:
                try:
                    fn = impl.bind(ctx)
                except Exception as e:  # a compiler or driver that cannot build the kernel
                    why = f"failed to load: {type(e).__name__}: {e}"
                else:
                    note = skipped[0][1] if len(skipped) == 1 else "; ".join(f"{n}: {w}" for n, w in skipped)
                    chosen[op] = BoundOp(impl, fn, note)
                    break
            skipped.append((impl.name, why))
        else:
            raise UnsupportedAttention(
                f"attention: no {op} implementation serves kv_dtype={ctx.fmt.name} on {ctx.device} "
                f"(head_dim {ctx.head_dim}, {ctx.dtype}): " + "; ".join(f"{n}: {w}" for n, w in skipped))
    return chosen


def select_backend(pool: Any, device: torch.device | str, dtype: torch.dtype, num_heads: int | None = None, *,
                   kind: str = "auto", force: Mapping[str, str] | None = None,
                   num_splits: int | None = None) -> Any:
    """The attention backend for this pool on this device: ``kind`` "auto" (reference on CPU, the
    kernels elsewhere), "reference" or "kernels"; ``force`` picks op implementations by name."""
    device = torch.device(device)
    if kind not in ("auto", "reference", "kernels"):
        raise ValueError(f"backend kind must be auto, reference or kernels, got {kind!r}")
    if kind == "reference" or (kind == "auto" and device.type == "cpu" and not force):
        from ninfer.attention.reference import ReferenceAttentionBackend
        return ReferenceAttentionBackend(pool)
    from ninfer.attention.triton_backend import KernelAttentionBackend
    return KernelAttentionBackend(pool, dtype=dtype, num_heads=num_heads, force=force, num_splits=num_splits)


def op_context(pool: Any, dtype: torch.dtype | None = None, num_heads: int | None = None) -> OpContext:
    return OpContext(fmt=pool.fmt, device=torch.device(pool.device),
                     dtype=dtype if dtype is not None else getattr(pool, "model_dtype", torch.bfloat16),
                     head_dim=int(pool.head_dim), num_heads=num_heads, num_kv_heads=int(pool.num_kv_heads),
                     page_size=int(pool.page_size))
