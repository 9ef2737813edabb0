"""The KV cache pool: per KV layer, one tensor per plane of the KV format, all allocated up front;
per recurrent layer, a state tensor set over a fixed pool of sequence slots.

Public API
----------
`KVCachePool(fmt, num_layers, num_kv_heads, head_dim, num_pages, page_size=PAGE_SIZE, device="cpu",
model_dtype=torch.bfloat16, *, states=(), num_slots=0)`; `fmt` is a KVFormat or its name.
`KVCachePool.from_spec(spec: CacheSpec, num_pages, num_slots, device, model_dtype)` (ninfer/kvcache/spec.py).
* `layers[i]`: dict plane name -> tensor [num_pages, num_kv_heads, page_size, extent]
  (i = attention-layer index: the i-th layer with an AttentionSpec, `CacheSpec.kv_index`)
* `states[j]`: dict state name -> tensor [num_slots, *shape], zero-filled (j = the j-th layer with a
  RecurrentStateSpec, `CacheSpec.state_index`); `num_slots`, `state_bytes_allocated` (states and
  windows), `reset_states(slots)` (zero the given slots in every state tensor)
* windowed formats (`fmt.window` = W > 0) with slots: `windows[i]`: {"k", "v"} -> tensor
  [num_slots, num_kv_heads, W, head_dim] in the model dtype, sequence slot s's K/V of position p at
  row p % W; `window_start` int32 [num_slots]: the first position slot s's sequence wrote (set by
  the model runner when a sequence takes the slot; rows before it were never written by it).
  Without slots (a pool built for kernel tests) there is no ring and attention reads pages only.
* `planes`: the format's plane tuple; `bytes_per_token`, `bytes_allocated`, `capacity_tokens`;
  `buffer`: the one flat uint8 allocation every plane is a view of
* `geometry_lines() -> list[str]`: what was allocated, for the startup log (DESIGN §2.2)
* `assert_geometry()`: raises GeometryError unless every tensor matches the format entry
  (planes, dtypes, extents, shapes, bytes) and packed formats really hold 4 bits per coordinate
* `KVCachePool.from_plan(plan, device, model_dtype, spec=None)`
Slot s lives at page s // page_size, offset s % page_size. Page 0 is a real page.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ninfer.config import PAGE_SIZE


class GeometryError(RuntimeError):
    """Allocated KV planes disagree with the format entry (e.g. full-width planes for a packed format)."""


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class KVCachePool:
    def __init__(self, fmt: Any, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = PAGE_SIZE, device: torch.device | str = "cpu",
                 model_dtype: torch.dtype = torch.bfloat16, *, states: Sequence[Any] = (),
                 num_slots: int = 0) -> None:
        if isinstance(fmt, str):
            from ninfer.kvcache.formats import get_format
            fmt = get_format(fmt)
        window = int(getattr(fmt, "window", 0)) if int(num_slots) >= 1 else 0
        if states and int(num_slots) < 1:
            raise ValueError(f"KVCachePool: recurrent states need num_slots >= 1, got {num_slots}")
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("num_pages", num_pages), ("page_size", page_size)):
            if int(v) < 1:
                raise ValueError(f"KVCachePool: {name} must be >= 1, got {v}")
        self.fmt = fmt
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        self.model_dtype = model_dtype
        self.planes = tuple(fmt.planes(head_dim, model_dtype))
        # One flat allocation carved into planes: the allocator adds no per-tensor rounding, so the
        # pool costs exactly what the planner reserved. Zero-filled: slots past a sequence's end
        # are masked, but 0 * NaN garbage would still be NaN.
        shapes = [(p, (num_pages, num_kv_heads, page_size, p.extent)) for p in self.planes]
        sizes = [_numel(shape) * _itemsize(p.dtype) for p, shape in shapes]
        self.buffer = torch.zeros(num_layers * sum(sizes), dtype=torch.uint8, device=self.device)
        self.layers: list[dict[str, torch.Tensor]] = []
        off = 0
        for _ in range(num_layers):
            layer = {}
            for (p, shape), size in zip(shapes, sizes):
                # Planes are multiples of page_size * 2 bytes (128 at page size 64), so every plane
                # stays aligned; assert_geometry checks 16 B.
                layer[p.name] = self.buffer[off:off + size].view(p.dtype).view(shape)
                off += size
            self.layers.append(layer)
        self.state_specs = tuple(states)
        self.num_slots = int(num_slots) if states or window else 0
        self.states: list[dict[str, torch.Tensor]] = [
            {n: torch.zeros((self.num_slots, *shape), dtype=st.dtype(n), device=self.device)
             for n, shape in st.shapes.items()} for st in self.state_specs]
        self.window = window
        ring = (self.num_slots, num_kv_heads, window, head_dim)
        self.windows: list[dict[str, torch.Tensor]] = [
            {kv: torch.zeros(ring, dtype=model_dtype, device=self.device) for kv in ("k", "v")}
            for _ in range(num_layers if window else 0)]
        self.window_start = torch.zeros(self.num_slots if window else 0, dtype=torch.int32, device=self.device)
        self.window_start_cpu = [0] * (self.num_slots if window else 0)  # the host's copy

    @classmethod
    def from_spec(cls, spec: Any, num_pages: int, num_slots: int, device: torch.device | str,
                  model_dtype: torch.dtype = torch.bfloat16, page_size: int = PAGE_SIZE) -> "KVCachePool":
        """Pages for the spec's attention layers, `num_slots` sequence slots for its recurrent layers
        and window rings."""
        a = spec.attention
        return cls(a.fmt, spec.num_kv_layers, a.num_kv_heads, a.head_dim, num_pages, page_size, device, model_dtype,
                   states=spec.state_specs, num_slots=num_slots)

    @classmethod
    def from_plan(cls, plan: Any, device: torch.device | str, model_dtype: torch.dtype | None = None,
                  spec: Any = None) -> "KVCachePool":
        """A pool exactly as large as a planner.MemoryPlan says (bytes_allocated == plan.kv_bytes,
        state_bytes_allocated == plan.state_bytes); `spec` is the CacheSpec the plan was made from."""
        if model_dtype is None:
            model_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.weights_dtype]
        if spec is None:
            if getattr(plan, "state_bytes", 0):
                raise ValueError("KVCachePool.from_plan: the plan has recurrent states; pass its CacheSpec")
            return cls(plan.kv_dtype, plan.num_kv_layers, plan.num_kv_heads, plan.head_dim, plan.num_pages,
                       plan.page_size, device, model_dtype)
        pool = cls.from_spec(spec, plan.num_pages, plan.max_num_seqs, device, model_dtype, plan.page_size)
        if pool.bytes_per_token != plan.bytes_per_token or pool.state_bytes_allocated != plan.state_bytes:
            raise ValueError(f"KVCachePool.from_plan: the spec gives {pool.bytes_per_token} B/token and "
                             f"{pool.state_bytes_allocated} state bytes, the plan {plan.bytes_per_token} and "
                             f"{plan.state_bytes}")
        return pool

    @property
    def state_bytes_allocated(self) -> int:
        """Bytes of every slot tensor: recurrent states and window rings."""
        return sum(t.numel() * t.element_size() for st in (*self.states, *self.windows) for t in st.values())

    def reset_states(self, slots: torch.Tensor | list[int]) -> None:
        """Zero the given state slots of every recurrent layer (a sequence starting from scratch)."""
        if not self.states:
            return
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        if idx.numel():
            for st in self.states:
                for t in st.values():
                    t.index_fill_(0, idx, 0)

    def set_window_start(self, slots: list[int], starts: list[int]) -> None:
        """Slots' rings start at these positions (device tensor and host copy)."""
        for slot, v in zip(slots, starts):
            self.window_start_cpu[slot] = int(v)
        idx = torch.tensor(slots, dtype=torch.long)
        self.window_start.index_copy_(0, idx.to(self.device), torch.tensor(starts, dtype=torch.int32).to(self.device))

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token over all layers and heads, from what the format says."""
        return int(self.fmt.bytes_per_token_head(self.head_dim, self.model_dtype)) * self.num_kv_heads * self.num_layers

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_allocated(self) -> int:
        """Bytes of device memory the pool holds (its one flat buffer)."""
        return self.buffer.numel()

    def geometry_lines(self) -> list[str]:
        """The format's line (it checks layer 0's tensors against itself), then the planes as
        actually allocated, read from the tensors."""
        t0 = self.layers[0]
        planes = " ".join(f"{n}={_dtype_name(t.dtype)}x{t.shape[-1]}" for n, t in t0.items())
        lines = [
            f"{self.fmt.geometry_line(self.head_dim, self.model_dtype, allocated=t0)} layers={self.num_layers}",
            f"kv pool: layers={self.num_layers} pages={self.num_pages} page_size={self.page_size} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} planes[{planes}] "
            f"bytes/token={self.bytes_per_token} allocated={self.bytes_allocated}",
        ]
        if self.states:
            tensors = " ".join(f"{n}={_dtype_name(t.dtype)}{list(t.shape[1:])}" for n, t in self.states[0].items())
            held = sum(t.numel() * t.element_size() for st in self.states for t in st.values())
            lines.append(f"state pool: layers={len(self.states)} slots={self.num_slots} layer0[{tensors}] "
                         f"bytes/seq={held // self.num_slots} allocated={held}")
        if self.windows:
            held = sum(t.numel() * t.element_size() for st in self.windows for t in st.values())
            t = self.windows[0]["k"]
            lines.append(f"window ring: layers={len(self.windows)} slots={self.num_slots} tokens={self.window} "
                         f"k,v={_dtype_name(t.dtype)}{list(t.shape[1:])} bytes/seq={held // self.num_slots} "
                         f"allocated={held}")
        return lines

    def assert_geometry(self) -> None:
        """Check every allocated tensor against the format entry; raise GeometryError on any mismatch."""
        fmt, D = self.fmt, self.head_dim
        expected = {p.name: p for p in fmt.planes(D, self.model_dtype)}
        errors: list[str] = []
        per_head = sum(p.extent * torch.empty((), dtype=p.dtype).element_size() for p in expected.values())
        if per_head != int(fmt.bytes_per_token_head(D, self.model_dtype)):
            errors.append(f"planes hold {per_head} B/token/head but the format says "
                          f"{fmt.bytes_per_token_head(D, self.model_dtype)}")
        if len(self.layers) != self.num_layers:
            errors.append(f"{len(self.layers)} layers allocated, {self.num_layers} expected")
        spans: list[tuple[int, int, str]] = []
        for i, layer in enumerate(self.layers):
            if set(layer) != set(expected):
                errors.append(f"layer {i}: planes {sorted(layer)} but the format has {sorted(expected)}")
                continue
            for name, t in layer.items():
                p = expected[name]
                shape = (self.num_pages, self.num_kv_heads, self.page_size, p.extent)
                if tuple(t.shape) != shape or t.dtype != p.dtype:
                    errors.append(f"layer {i} plane {name}: {_dtype_name(t.dtype)}{list(t.shape)}, "
                                  f"format wants {_dtype_name(p.dtype)}{list(shape)}")
                if not t.is_contiguous() or t.device.type != self.device.type or t.data_ptr() % 16:
                    errors.append(f"layer {i} plane {name}: not a contiguous, 16-byte aligned tensor on {self.device}")
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), f"layer {i} plane {name}"))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                errors.append(f"{b} aliases {a}")
        # The flags themselves must agree with the planes: a packed format stores two 4-bit
        # coordinates per byte, a scaled one has fp16 scales per 64 coordinates.
        for kv in ("k", "v"):
            p = expected.get(kv)
            if p is None:
                errors.append(f"format has no {kv!r} plane")
                continue
            bits = p.extent * torch.empty((), dtype=p.dtype).element_size() * 8 / D
            if fmt.packed and bits != 4:
                errors.append(f"packed format {fmt.name} stores {bits:g} bits per {kv} coordinate, not 4")
            if not fmt.packed and bits < 8:
                errors.append(f"unpacked format {fmt.name} stores only {bits:g} bits per {kv} coordinate")
            sc = expected.get(f"{kv}_scale")
            if fmt.has_scales and (sc is None or sc.dtype != torch.float16 or sc.extent != D // 64):
                errors.append(f"format {fmt.name} has scales but plane {kv}_scale is {sc}")
            if not fmt.has_scales and sc is not None:
                errors.append(f"format {fmt.name} has no scales but allocates {kv}_scale")
        planes_bytes = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())
        if not self.bytes_allocated == planes_bytes == self.bytes_per_token * self.capacity_tokens:
            errors.append(f"allocated {self.bytes_allocated} bytes ({planes_bytes} in planes), the format "
                          f"implies {self.bytes_per_token * self.capacity_tokens}")
        for j, (spec, st) in enumerate(zip(self.state_specs, self.states)):
            for n, shape in spec.shapes.items():
                t = st.get(n)
                if t is None or tuple(t.shape) != (self.num_slots, *shape) or t.dtype != spec.dtype(n):
                    errors.append(f"state layer {j} tensor {n}: {None if t is None else list(t.shape)}, spec wants "
                                  f"{_dtype_name(spec.dtype(n))}{[self.num_slots, *shape]}")
        ring = (self.num_slots, self.num_kv_heads, self.window, D)
        if any(tuple(t.shape) != ring or t.dtype != self.model_dtype or not t.is_contiguous()
               for st in self.windows for t in st.values()) or len(self.windows) != (self.num_layers if self.window else 0):
            errors.append(f"window rings are not {len(self.windows)} x contiguous {_dtype_name(self.model_dtype)}{list(ring)}")
        if errors:
            raise GeometryError(f"KV plane geometry does not match kv_dtype={fmt.name}: " + "; ".join(errors))
