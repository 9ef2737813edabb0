"""What each model layer keeps between steps: the cache spec the planner, pool and block manager derive from.

* ``AttentionSpec(num_kv_heads, head_dim, fmt)``: paged K/V in a KV format; costs bytes per token.
* ``RecurrentStateSpec(shapes, dtypes)``: a fixed-size state per sequence (e.g. a linear-attention
  or SSM state and a conv window); costs bytes per sequence, whatever its length.
* ``CacheSpec(layers)``: one entry per model layer (None: the layer keeps nothing).

The contract with a model (``model.cache_specs(fmt) -> CacheSpec``; the dense decoder declares an
AttentionSpec for every layer):
* The pool (``KVCachePool.from_spec``) numbers layers of each kind in model-layer order:
  ``pool.layers[i]`` is the i-th attention layer's planes (``CacheSpec.kv_index``: model layer ->
  i; the model's attention module passes i to ``backend.forward``), ``pool.states[j]`` the j-th
  recurrent layer's state, ``{name: tensor [max_num_seqs slots, *shape]}`` zero-filled
  (``CacheSpec.state_index``; read it in the model as ``backend.state(j)``).
* Every running request holds one state slot from admission to finish, abort or preemption
  (``BlockManager`` allocates it with the pages; ``request.state_slot``). Per step the metadata
  carries ``meta.state_slots`` [B] int32 (the row of each sequence in every state tensor) and
  ``meta.has_initial_state`` [B] bool: True when the sequence had computed tokens before this step
  (continue from the stored state, e.g. the next prefill chunk), False when it starts from zeros
  (the runner also zero-fills such slots before the step, so a preempted request restarts clean).
  The layer reads and writes the state in place at those rows.
* Prefix reuse: a KV page is only valid with the matching recurrent state, so an engine whose
  spec has any RecurrentStateSpec turns prefix caching off (a startup line says so).
* A windowed format (``fmt.window`` = W > 0, rk4v4-e8w) adds per-sequence memory to every attention
  layer: a model-dtype ring of the sequence's last W tokens' K and V (``pool.windows[i]``, rows =
  the same sequence slots as the states). It costs ``window_bytes_per_seq``; it does not turn prefix
  reuse off (tokens whose ring rows a sequence did not write are read from the pages).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

import torch

from ninfer.kvcache.formats import KVFormat


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


@dataclass(frozen=True)
class AttentionSpec:
    """Paged K/V of ``num_kv_heads`` heads of ``head_dim`` in format ``fmt``."""
    num_kv_heads: int
    head_dim: int
    fmt: KVFormat

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"AttentionSpec needs num_kv_heads and head_dim >= 1, got {self.num_kv_heads}, "
                             f"{self.head_dim}")
        self.fmt.data_extent(self.head_dim)  # the format's head_dim rule

    def bytes_per_token(self, model_dtype: torch.dtype = torch.bfloat16) -> int:
        return int(self.fmt.bytes_per_token_head(self.head_dim, model_dtype)) * self.num_kv_heads

    def window_bytes_per_seq(self, model_dtype: torch.dtype = torch.bfloat16) -> int:
        """The ring of a windowed format: W tokens x Hkv x D x (K, V) in the model dtype."""
        return self.fmt.window * self.num_kv_heads * self.head_dim * 2 * _itemsize(model_dtype)


@dataclass(frozen=True, eq=True)
class RecurrentStateSpec:
    """Per-sequence state tensors ``{name: shape}`` with ``dtypes`` ``{name: dtype}`` (or one dtype for all)."""
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype] | torch.dtype = torch.float32
    _dtypes: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("RecurrentStateSpec needs at least one state tensor")
        shapes = {str(n): tuple(int(d) for d in s) for n, s in self.shapes.items()}
        for n, s in shapes.items():
            if any(d < 1 for d in s):
                raise ValueError(f"RecurrentStateSpec: state {n!r} has shape {s}; every dimension must be >= 1")
        if isinstance(self.dtypes, torch.dtype):
            dts = {n: self.dtypes for n in shapes}
        else:
            dts = dict(self.dtypes)
            if set(dts) != set(shapes):
                raise ValueError(f"RecurrentStateSpec: dtypes for {sorted(dts)} but states {sorted(shapes)}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "_dtypes", dts)

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[name]

    def bytes_per_seq(self) -> int:
        total = 0
        for n, s in self.shapes.items():
            count = 1
            for d in s:
                count *= d
            total += count * _itemsize(self._dtypes[n])
        return total

    def __hash__(self) -> int:
        return hash((tuple(self.shapes.items()), tuple(self._dtypes.items())))


LayerSpec = Union[AttentionSpec, RecurrentStateSpec, None]


@dataclass(frozen=True)
class CacheSpec:
    """One spec per model layer. The attention layers must share one geometry (one pool of pages)."""
    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, s in enumerate(self.layers):
            if s is not None and not isinstance(s, (AttentionSpec, RecurrentStateSpec)):
                raise TypeError(f"cache spec of layer {i} is a {type(s).__name__}, not AttentionSpec / "
                                "RecurrentStateSpec / None")
        att = self.attention_specs
        if not att:
            raise ValueError("a cache spec needs at least one attention layer")
        if len(set(att)) > 1:
            raise ValueError(f"attention layers disagree on their KV geometry: {sorted(set(map(repr, att)))}")

    @classmethod
    def uniform_attention(cls, num_layers: int, num_kv_heads: int, head_dim: int, fmt: KVFormat) -> "CacheSpec":
        """Every layer an AttentionSpec (the dense decoders)."""
        return cls((AttentionSpec(num_kv_heads, head_dim, fmt),) * num_layers)

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        return [s for s in self.layers if isinstance(s, AttentionSpec)]

    @property
    def state_specs(self) -> list[RecurrentStateSpec]:
        return [s for s in self.layers if isinstance(s, RecurrentStateSpec)]

    @property
    def attention(self) -> AttentionSpec:
        """The one attention geometry (num_kv_heads, head_dim, fmt)."""
        return self.attention_specs[0]

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_specs)

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.state_specs)

    def kv_index(self) -> dict[int, int]:
        """model layer -> index in pool.layers, for the attention layers."""
        ids = [i for i, s in enumerate(self.layers) if isinstance(s, AttentionSpec)]
        return {layer: j for j, layer in enumerate(ids)}

    def state_index(self) -> dict[int, int]:
        """model layer -> index in pool.states, for the recurrent layers."""
        ids = [i for i, s in enumerate(self.layers) if isinstance(s, RecurrentStateSpec)]
        return {layer: j for j, layer in enumerate(ids)}

    def bytes_per_token(self, model_dtype: torch.dtype = torch.bfloat16) -> int:
        """KV bytes per token over every attention layer (states cost nothing per token)."""
        return sum(s.bytes_per_token(model_dtype) for s in self.attention_specs)

    def state_bytes_per_seq(self) -> int:
        """Recurrent-state bytes of one sequence over every recurrent layer."""
        return sum(s.bytes_per_seq() for s in self.state_specs)

    @property
    def window(self) -> int:
        """W of the attention format's ring (0: none)."""
        return self.attention.fmt.window

    @property
    def needs_slots(self) -> bool:
        """Every running sequence holds a slot (recurrent states or a window ring)."""
        return self.has_recurrent_state or self.window > 0

    def window_bytes_per_seq(self, model_dtype: torch.dtype = torch.bfloat16) -> int:
        """Window-ring bytes of one sequence over every attention layer (0 without a window)."""
        return sum(s.window_bytes_per_seq(model_dtype) for s in self.attention_specs)

    def slot_bytes_per_seq(self, model_dtype: torch.dtype = torch.bfloat16) -> int:
        """Everything a sequence slot holds: recurrent states and window rings."""
        return self.state_bytes_per_seq() + self.window_bytes_per_seq(model_dtype)
