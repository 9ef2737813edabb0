"""Memory reservation arithmetic (DESIGN §3): decide, before anything big is allocated, how many KV
pages the device holds, and refuse a context that cannot fit with the numbers instead of running
out of memory later.

Public API
----------
* `plan_memory(model, *, kv_dtype, total_bytes, free_bytes, max_context=None, kv_capacity="auto",
  max_num_seqs=64, max_num_batched_tokens="auto", weights_dtype="auto", device_type="cuda",
  enforce_eager=False, headroom_bytes=None, weights_bytes=None, weights_resident=False,
  cache_spec=None, tensor_parallel_size=1) -> MemoryPlan`
* `plan_for_engine(model, cfg: EngineConfig, mem: DeviceMemory, device_type, ...) -> MemoryPlan`
* `MemoryPlan` (frozen): every term in bytes, `num_pages`, `capacity_tokens`, `bytes_per_token`,
  derived `runtime_bytes`, `free_after_weights`, `free_after_startup`, `slack_bytes`,
  `largest_context`; `capacity_line()`, `summary_lines()`, `with_observed(...)`, `as_dict()`.
* `ContextDoesNotFit(ValueError)`: `.needed_bytes`, `.available_bytes`, `.largest_context`;
  `StatesDoNotFit(ContextDoesNotFit)`: max_num_seqs recurrent states alone do not fit (`.max_num_seqs_fit`).
* `default_cache_spec(model, kv_dtype)`: an AttentionSpec per full-attention layer (ninfer/kvcache/spec.py).
* `device_memory(device, memory_limit_gib=None) -> DeviceMemory(total, free)` (from memory.py).
* `kv_bytes_per_token(model, kv_dtype, model_dtype)`, `canonical_kv_dtype(name)`,
  `resolve_weights_dtype(name, model)`, `activation_workspace(...)`, `cuda_graph_batch_sizes(n)`,
  `default_headroom(total)`, `format_bytes(n)`.

Terms (all bytes; "context pages" = ceil(max_context / PAGE_SIZE)):
  weights       model.weight_bytes(dtype) (a rank's shard under tensor parallel), or the exact size
                the loader reports
  kv            num_pages * PAGE_SIZE * bytes_per_token; bytes_per_token = the cache spec's attention
                layers: format.bytes_per_token_head(D) * num_kv_heads * attention layers
  states        max_num_seqs * the spec's slot bytes per sequence (one slot per running sequence:
                recurrent states, plus the window ring of a windowed format such as rk4v4-e8w)
  page_tables   max_num_seqs * context pages * 4 (int32 block table, one row per running sequence)
  workspace     activations of the largest prefill chunk (see `activation_workspace`); the chunk
                is max_num_batched_tokens, or the planner's choice for "auto" (see `plan_memory`)
  graphs        decode CUDA-graph pool + its static block table (0 when eager or on CPU; `_graph_pool_bytes`)
  headroom      kept free for the allocator's fragmentation and library handles (1 GiB, or a tenth
                of a small device)
runtime = kv + states + page_tables + workspace + graphs; a plan fits when weights + runtime + headroom
<= free. Everything but kv and page_tables is independent of the context, so the largest context
that fits has a closed form (see `plan_memory`). There is no RoPE table term: cos/sin are computed
from the positions of each step (layers/rotary.py), inside the workspace.

Tensor parallel (N ranks): every term is one rank's, planned on that rank's geometry
(layers/tp_geometry.py: heads, KV heads, GDN heads and intermediate size divided by N): weights =
the shard a rank holds, KV = its KV heads, states = its GDN heads. The context capacity in tokens is
the group's (every rank holds its heads of the same tokens); the capacity line adds the group totals.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from ninfer import dtypes
from ninfer.config import PAGE_SIZE
from ninfer.kvcache.memory import GiB, MiB, DeviceMemory, device_memory, format_bytes  # noqa: F401
from ninfer.kvcache.workspace import (AUTO_PREFILL_CHUNKS, CHUNK_KV_SHARE, DECODE_MAX_SPLITS,  # noqa: F401
                                      GRAPH_BYTES_PER_CAPTURE, _graph_pool_bytes, activation_workspace,
                                      cuda_graph_batch_sizes)
from ninfer.layers.tp_geometry import local_config, shard_param_count
from ninfer.model_config import ModelConfig

DEFAULT_HEADROOM_BYTES = GiB          # the seed engine's automatic headroom
BLOCK_TABLE_ENTRY_BYTES = 4           # int32 page ids
_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}
_DTYPE_CANON = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class ContextDoesNotFit(ValueError):
    """The requested context (or capacity) cannot be reserved on this device with this kv-dtype."""

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int, largest_context: int,
                 kv_dtype: str, max_context: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.largest_context = largest_context
        self.kv_dtype = kv_dtype
        self.max_context = max_context


class StatesDoNotFit(ContextDoesNotFit):
    """The recurrent states of max_num_seqs sequences do not fit next to the weights and workspace."""

    def __init__(self, message: str, *, max_num_seqs_fit: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.max_num_seqs_fit = max_num_seqs_fit


def resolve_weights_dtype(name: str | None, model: ModelConfig) -> str:
    """'auto' -> the config's torch_dtype; any spelling -> bf16 | fp16 | fp32."""
    name = model.torch_dtype if name in ("auto", None) else name
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown weights dtype {name!r}; choose one of auto, bf16, fp16, fp32")
    return _DTYPE_CANON.get(name, name)


def _torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def canonical_kv_dtype(kv_dtype: str) -> str:
    """The registry's name for kv_dtype; ValueError for unknown or refused names."""
    from ninfer.kvcache.formats import get_format  # lazy: the registry imports torch
    return get_format(kv_dtype).name


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str, model_dtype: str = "bf16") -> int:
    """KV payload per token over all full-attention layers and KV heads, scales included."""
    from ninfer.kvcache.formats import get_format
    fmt = get_format(kv_dtype)
    per_head = int(fmt.bytes_per_token_head(model.head_dim, _torch_dtype(model_dtype)))
    return per_head * model.num_kv_heads * model.num_kv_layers


def default_cache_spec(model: ModelConfig, kv_dtype: Any) -> Any:
    """An AttentionSpec for every full-attention layer of the config; the others get the config's
    recurrent state (hybrids, float32) or None."""
    import torch

    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.spec import AttentionSpec, CacheSpec, RecurrentStateSpec
    att = AttentionSpec(model.num_kv_heads, model.head_dim, get_format(kv_dtype))
    shapes = model.recurrent_state_shapes()
    rec = RecurrentStateSpec(shapes, torch.float32) if shapes else None
    full = set(model.full_attention_layers)
    return CacheSpec(tuple(att if i in full else rec for i in range(model.num_layers)))


@dataclass(frozen=True)
class MemoryPlan:
    kv_dtype: str
    capacity_mode: str            # "auto" | "explicit"
    device_type: str              # "cuda" | "cpu"
    max_context: int
    max_num_seqs: int
    max_num_batched_tokens: int
    weights_dtype: str
    page_size: int
    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_token: int          # KV payload per token, all KV layers and heads
    page_bytes: int               # bytes_per_token * page_size
    num_pages: int
    capacity_tokens: int          # num_pages * page_size
    total_bytes: int              # device total (or --memory-limit)
    free_bytes: int               # free before weights
    weights_bytes: int
    kv_bytes: int
    page_table_bytes: int
    workspace_bytes: int
    graph_bytes: int              # planned CUDA-graph pool
    headroom_bytes: int
    largest_context: int          # largest max_context that fits with this kv_dtype (pool = one context)
    graph_bytes_observed: int | None = None
    free_after_startup_observed: int | None = None
    state_bytes: int = 0          # recurrent states and window rings: max_num_seqs slots
    state_bytes_per_seq: int = 0
    window_bytes_per_seq: int = 0  # the window ring's part of state_bytes_per_seq
    tensor_parallel_size: int = 1  # >1: every byte term above is one rank's
    prefill_chunk_mode: str = "explicit"  # max_num_batched_tokens given, or "auto" (the planner's choice)

    @property
    def runtime_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.page_table_bytes + self.workspace_bytes + self.graph_bytes

    @property
    def free_after_weights(self) -> int:
        return self.free_bytes - self.weights_bytes

    @property
    def free_after_startup(self) -> int:
        if self.free_after_startup_observed is not None:
            return self.free_after_startup_observed
        return self.free_after_weights - self.runtime_bytes

    @property
    def slack_bytes(self) -> int:
        return self.free_after_startup - self.headroom_bytes

    @property
    def max_concurrency_at_max_context(self) -> float:
        return self.capacity_tokens / self.max_context

    def with_observed(self, *, graph_bytes: int | None = None, free_after_startup: int | None = None) -> "MemoryPlan":
        """The same plan with what the engine measured after startup (graph pool, device free)."""
        return replace(self, graph_bytes_observed=graph_bytes, free_after_startup_observed=free_after_startup)

    def capacity_line(self) -> str:
        observed = "-" if self.graph_bytes_observed is None else format_bytes(self.graph_bytes_observed)
        return (f"KV capacity {self.capacity_mode} resolved={self.capacity_tokens} tokens pages={self.num_pages} "
                f"bytes/token={self.bytes_per_token} runtime={format_bytes(self.runtime_bytes)} "
                f"free-after-weights={format_bytes(self.free_after_weights)} "
                f"free-after-startup={format_bytes(self.free_after_startup)} "
                f"headroom={format_bytes(self.headroom_bytes)} slack={format_bytes(self.slack_bytes)} "
                f"graphs={observed}/{format_bytes(self.graph_bytes)} "
                f"prefill chunk {self.max_num_batched_tokens} ({self.prefill_chunk_mode})"
                + (f" states={format_bytes(self.state_bytes)} ({self.state_bytes_per_seq} B/seq x "
                   f"{self.max_num_seqs} slots" + (f", window {self.window_bytes_per_seq} B/seq"
                                                   if self.window_bytes_per_seq else "") + ")"
                   if self.state_bytes else "") + self._group())

    def _group(self) -> str:
        n = self.tensor_parallel_size
        if n == 1:
            return ""
        return (f"; per rank of tensor-parallel {n}, group: bytes/token={n * self.bytes_per_token} "
                f"weights={format_bytes(n * self.weights_bytes)} kv={format_bytes(n * self.kv_bytes)}"
                + (f" states={format_bytes(n * self.state_bytes)}" if self.state_bytes else ""))

    def summary_lines(self) -> list[str]:
        """The facts vLLM users look for, plus every reserved term."""
        return [
            f"Available KV cache memory: {format_bytes(self.kv_bytes)} (kv_dtype={self.kv_dtype}, "
            f"{self.bytes_per_token} B/token" + (f", per rank of {self.tensor_parallel_size}"
                                                 if self.tensor_parallel_size > 1 else "") + ")",
            f"KV cache size: {self.capacity_tokens} tokens",
            f"Maximum concurrency for {self.max_context} tokens per request: "
            f"{self.max_concurrency_at_max_context:.2f}x",
            "memory plan: " + " ".join(f"{k}={format_bytes(v)}" for k, v in self.terms().items()),
        ]

    def terms(self) -> dict[str, int]:
        t = {"weights": self.weights_bytes, "kv": self.kv_bytes}
        if self.state_bytes:
            t["states"] = self.state_bytes
        t.update(page_tables=self.page_table_bytes, workspace=self.workspace_bytes, graphs=self.graph_bytes,
                 headroom=self.headroom_bytes)
        return t

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(runtime_bytes=self.runtime_bytes, free_after_weights=self.free_after_weights,
                 free_after_startup=self.free_after_startup, slack_bytes=self.slack_bytes,
                 capacity_line=self.capacity_line())
        return d


def default_headroom(total_bytes: int) -> int:
    # 1 GiB on a real card; a tenth of a small (emulated or CPU-limited) device so tiny models still plan.
    return min(DEFAULT_HEADROOM_BYTES, total_bytes // 10)


def plan_memory(model: ModelConfig, *, max_num_batched_tokens: int | str = "auto", device_type: str = "cuda",
                **kw: Any) -> MemoryPlan:
    """`_plan_memory` (its keywords) with the prefill chunk resolved: a number is taken as given;
    "auto" is the largest of AUTO_PREFILL_CHUNKS (each capped at max_context, rounded up to a page)
    whose workspace over the smallest one's costs at most CHUNK_KV_SHARE of the KV pool the smallest
    one leaves, and that fits; the smallest on CPU or when no larger one qualifies."""
    if str(max_num_batched_tokens).strip().lower() != "auto":
        return _plan_memory(model, max_num_batched_tokens=int(max_num_batched_tokens), device_type=device_type, **kw)
    base = replace(_plan_memory(model, max_num_batched_tokens=AUTO_PREFILL_CHUNKS[-1], device_type=device_type,
                                **kw), prefill_chunk_mode="auto")
    if device_type != "cuda":
        return base
    need = math.ceil(base.max_context / PAGE_SIZE) * PAGE_SIZE  # a longer chunk than the context buys nothing
    for chunk in sorted({min(c, need) for c in AUTO_PREFILL_CHUNKS}, reverse=True):
        if chunk <= base.max_num_batched_tokens:
            break
        try:
            plan = _plan_memory(model, max_num_batched_tokens=chunk, device_type=device_type, **kw)
        except ContextDoesNotFit:
            continue
        if plan.workspace_bytes - base.workspace_bytes <= CHUNK_KV_SHARE * base.kv_bytes:
            return replace(plan, prefill_chunk_mode="auto")
    return base


def _plan_memory(model: ModelConfig, *, kv_dtype: str, total_bytes: int, free_bytes: int,
                 max_context: int | None = None, kv_capacity: int | str = "auto", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 8192, weights_dtype: str = "auto", device_type: str = "cuda",
                 enforce_eager: bool = False, headroom_bytes: int | None = None,
                 weights_bytes: int | None = None, weights_resident: bool = False,
                 cache_spec: Any = None, tensor_parallel_size: int = 1) -> MemoryPlan:
    """Resolve the KV pool for one kv-dtype (for one rank of `tensor_parallel_size`; `weights_bytes`
    and `cache_spec`, when given, are that rank's). `free_bytes` is measured before the weights are loaded,
    unless `weights_resident` (then it is the free memory with the weights already in place).
    `cache_spec` (a CacheSpec; default: `default_cache_spec`) says which layers hold paged KV and
    which a recurrent state; its attention format must be `kv_dtype`'s.
    Raises StatesDoNotFit when max_num_seqs states alone do not fit, ContextDoesNotFit when even one
    max_context sequence (or the explicit capacity) does not fit, ValueError for inconsistent knobs."""
    max_context = int(model.max_position_embeddings if max_context is None else max_context)
    for name, v in (("max_context", max_context), ("max_num_seqs", max_num_seqs),
                    ("max_num_batched_tokens", max_num_batched_tokens)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    wdtype = resolve_weights_dtype(weights_dtype, model)
    kv_dtype = canonical_kv_dtype(kv_dtype)
    act = _DTYPE_BYTES[wdtype]
    tp = int(tensor_parallel_size)
    shard_params = shard_param_count(model, tp)  # ConfigError (a ValueError) when tp does not divide
    # one process: the config's real bytes (quantized linears packed); a rank: its shard
    full_bytes = model.weight_bytes(wdtype) if tp == 1 else None
    model = local_config(model, tp)
    spec = default_cache_spec(model, kv_dtype) if cache_spec is None else cache_spec
    if spec.attention.fmt.name != kv_dtype:
        raise ValueError(f"the cache spec's KV format is {spec.attention.fmt.name}, the plan's kv_dtype {kv_dtype}")
    if spec.attention.num_kv_heads != model.num_kv_heads:
        raise ValueError(f"the cache spec has {spec.attention.num_kv_heads} KV heads, a rank of tensor-parallel "
                         f"{tp} holds {model.num_kv_heads}")
    bpt = spec.bytes_per_token(_torch_dtype(wdtype))
    state_per_seq = spec.slot_bytes_per_seq(_torch_dtype(wdtype))
    states = max_num_seqs * state_per_seq
    page_bytes = bpt * PAGE_SIZE
    ctx_pages = math.ceil(max_context / PAGE_SIZE)
    if weights_bytes is None:
        weights_bytes = full_bytes if full_bytes is not None else shard_params * dtypes.num_bytes(wdtype)
    w_bytes = int(weights_bytes)
    if weights_resident:
        free_bytes += w_bytes
    headroom = default_headroom(total_bytes) if headroom_bytes is None else int(headroom_bytes)
    workspace = sum(activation_workspace(model, max_num_batched_tokens, act, max_num_seqs).values())
    if device_type == "cuda" and model.num_kv_layers:  # the SDPA prefill's buffers (added whole: conservative)
        from ninfer.attention.prefill_sdpa import workspace_bytes as sdpa_prefill_bytes
        workspace += sdpa_prefill_bytes(model.num_heads, model.num_kv_heads, model.head_dim, max_num_batched_tokens,
                                        elem=act)
    use_graphs = not enforce_eager and device_type == "cuda"
    graph_pool = _graph_pool_bytes(model, act, max_num_seqs) if use_graphs else 0
    # Per context page: page-table entries of every running sequence (a second, static copy for the
    # graphs). Everything else is independent of the context.
    table_copies = 2 if use_graphs else 1
    per_ctx_page = table_copies * max_num_seqs * BLOCK_TABLE_ENTRY_BYTES
    fixed = w_bytes + workspace + graph_pool + headroom + states
    # Largest context L (pages) with a pool of exactly L pages: fixed + L*(page + per_ctx_page) <= free.
    largest = max(0, (free_bytes - fixed) // (page_bytes + per_ctx_page)) * PAGE_SIZE
    page_tables = max_num_seqs * ctx_pages * BLOCK_TABLE_ENTRY_BYTES
    graph_tables = page_tables if use_graphs else 0
    graphs = graph_pool + graph_tables
    kv_room = free_bytes - fixed - graph_tables - page_tables  # what is left for KV pages

    if str(kv_capacity).strip().lower() == "auto":
        mode = "auto"
        # No point holding more than every running sequence at full length.
        pages = min(max(kv_room, 0) // page_bytes, max_num_seqs * ctx_pages)
        min_pages = ctx_pages
    else:
        mode = "explicit"
        cap = int(kv_capacity)
        if cap < max_context:
            raise ValueError(f"kv_capacity={cap} tokens is smaller than max_context={max_context}: one "
                             f"full-length request could never run; raise --kv-capacity or lower --max-context")
        pages = min_pages = math.ceil(cap / PAGE_SIZE)
    if states and kv_room < min_pages * page_bytes <= kv_room + states:
        # Without the states it would fit: they are what does not (page tables, workspace and graphs
        # shrink with fewer sequences too, so `fit` sequences certainly fit).
        fit = (kv_room + states - min_pages * page_bytes) // state_per_seq
        raise StatesDoNotFit(
            f"max_num_seqs={max_num_seqs} does not fit: its sequence slots (recurrent states, window rings) need {states} bytes "
            f"({format_bytes(states)}: {state_per_seq} B/seq x {max_num_seqs} slots) but only "
            f"{kv_room + states - min_pages * page_bytes} bytes are left after weights {format_bytes(w_bytes)}, "
            f"KV {format_bytes(min_pages * page_bytes)}, page tables {format_bytes(page_tables + graph_tables)}, "
            f"workspace {format_bytes(workspace)}, graphs {format_bytes(graph_pool)} and headroom "
            f"{format_bytes(headroom)}; at most {fit} sequences' states fit (lower --max-num-seqs)",
            max_num_seqs_fit=int(fit), needed_bytes=free_bytes - kv_room + min_pages * page_bytes,
            available_bytes=free_bytes, largest_context=0, kv_dtype=kv_dtype, max_context=max_context)
    if kv_room < min_pages * page_bytes:
        needed = fixed + graph_tables + page_tables + min_pages * page_bytes
        what = (f"max_context={max_context}" if mode == "auto"
                else f"kv_capacity={min_pages * PAGE_SIZE} tokens (max_context={max_context})")
        raise ContextDoesNotFit(
            f"{what} does not fit with kv_dtype={kv_dtype} ({bpt} B/token): it needs {needed} bytes "
            f"({format_bytes(needed)}: weights {format_bytes(w_bytes)} + KV {format_bytes(min_pages * page_bytes)} + "
            + (f"states {format_bytes(states)} + " if states else "")
            + f"page tables {format_bytes(page_tables)} + workspace {format_bytes(workspace)} + graphs {format_bytes(graphs)} + headroom {format_bytes(headroom)}) "
            f"but only {free_bytes} bytes ({format_bytes(free_bytes)}) are available; the largest context that "
            f"fits with {kv_dtype} is {largest} tokens"
            + (f" (weights, {'states, ' if states else ''}workspace, graphs and headroom alone need {fixed} bytes)"
               if largest == 0 else ""),
            needed_bytes=needed, available_bytes=free_bytes, largest_context=largest,
            kv_dtype=kv_dtype, max_context=max_context)
    return MemoryPlan(
        kv_dtype=kv_dtype, capacity_mode=mode, device_type=device_type, max_context=max_context,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, weights_dtype=wdtype,
        page_size=PAGE_SIZE, num_kv_layers=spec.num_kv_layers, num_kv_heads=spec.attention.num_kv_heads,
        head_dim=spec.attention.head_dim, bytes_per_token=bpt, page_bytes=page_bytes, num_pages=int(pages),
        capacity_tokens=int(pages) * PAGE_SIZE, total_bytes=total_bytes, free_bytes=free_bytes,
        weights_bytes=w_bytes, kv_bytes=int(pages) * page_bytes, page_table_bytes=page_tables,
        workspace_bytes=workspace, graph_bytes=graphs, headroom_bytes=headroom,
        largest_context=int(largest), state_bytes=int(states), state_bytes_per_seq=int(state_per_seq),
        window_bytes_per_seq=spec.window_bytes_per_seq(_torch_dtype(wdtype)), tensor_parallel_size=tp)


def plan_for_engine(model: ModelConfig, cfg: Any, mem: DeviceMemory, device_type: str, *,
                    max_context: int | None = None, weights_bytes: int | None = None,
                    weights_resident: bool = False, cache_spec: Any = None) -> MemoryPlan:
    """`plan_memory` with the knobs of an EngineConfig (`max_context` overrides cfg's, e.g. after
    the engine resolved rope scaling), for one rank of this process's tensor-parallel group."""
    return plan_memory(
        model, kv_dtype=cfg.kv_dtype, total_bytes=mem.total, free_bytes=mem.free,
        max_context=max_context if max_context is not None else cfg.max_context,
        kv_capacity=cfg.kv_capacity, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, weights_dtype=cfg.dtype, device_type=device_type,
        enforce_eager=cfg.enforce_eager, weights_bytes=weights_bytes, weights_resident=weights_resident,
        cache_spec=cache_spec, tensor_parallel_size=_tp_size(cfg))


def _tp_size(cfg: Any) -> int:
    """The group this process is in (its model and cache spec are one rank's), else the config's."""
    from ninfer.distributed import parallel_state
    return parallel_state.tp_size() if parallel_state.tp_size() > 1 else int(getattr(cfg, "tensor_parallel_size", 1) or 1)
