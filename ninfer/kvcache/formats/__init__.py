"""KV format registry (DESIGN 2, docs/ARCHITECTURE.md "KV formats").

Layout: ``base.py`` is the contract (``KVFormat``, ``Plane``, the scale helpers, the kernel codes);
one module per format family (``unquantized.py``: auto, bf16; ``int8.py``; ``rk4v4.py``;
``rk4v4_e8.py``: rk4v4-e8 and rk4v4-e8w). Every other module (planner, pool, backends, kernels, logs) receives the format
OBJECT from ``get_format``; ``encode`` / ``decode`` are the torch reference the kernels are
tested against.

Adding a format: a module with a ``KVFormat`` subclass and its instance, ``register_format`` it
(here for a built-in), then kernels keyed by its ``kernel_code`` (or none: the reference backend
serves any format, a kernel backend refuses one it has no kernels for at startup).
"""
from __future__ import annotations

from ninfer.kvcache.formats.base import (GROUP, KERNEL_E8, KERNEL_INT8, KERNEL_PLAIN, KERNEL_RK4,  # noqa: F401
                                         KVFormat, Plane, ScaledFormat, check_finite, code_units, group_scales)
from ninfer.kvcache.formats.int8 import C_INT8, INT8
from ninfer.kvcache.formats.rk4v4 import C_RK4, RK4V4
from ninfer.kvcache.formats.rk4v4_e8 import C_E8, RK4V4_E8, RK4V4_E8W
from ninfer.kvcache.formats.unquantized import AUTO, BF16

__all__ = ["GROUP", "C_INT8", "C_RK4", "C_E8", "KVFormat", "Plane", "ScaledFormat", "code_units", "group_scales",
           "get_format", "register_format", "unregister_format", "FORMAT_NAMES", "format_names"]

_REFUSED = {
    "rk2v4-e8": "rk2v4-e8 is refused: the 2-bit E8-root (cylinder) key codebook of the seed lineage "
                "loses too much K precision for retrieval and has no exact-decode spec here; use rk4v4-e8",
}
_FORMATS: dict[str, KVFormat] = {f.name: f for f in (AUTO, BF16, INT8, RK4V4, RK4V4_E8, RK4V4_E8W)}
FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)  # the built-in formats (CLI choices)


def format_names() -> tuple[str, ...]:
    """Every registered name, built-in and added with register_format."""
    return tuple(_FORMATS)


def register_format(fmt: KVFormat) -> KVFormat:
    """Make ``fmt`` reachable by name. Its name must be lower case, new (or the same object) and not refused."""
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"register_format needs a KVFormat, got {type(fmt).__name__}")
    key = fmt.name
    if key != key.strip().lower() or not key:
        raise ValueError(f"format name {key!r} must be non-empty lower case without spaces at the ends")
    if key in _REFUSED:
        raise ValueError(_REFUSED[key])
    if _FORMATS.get(key, fmt) is not fmt:
        raise ValueError(f"kv_dtype {key!r} is already registered")
    _FORMATS[key] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format added with register_format (built-ins stay)."""
    if name in FORMAT_NAMES:
        raise ValueError(f"kv_dtype {name!r} is built in")
    _FORMATS.pop(name, None)


def get_format(name: str | KVFormat) -> KVFormat:
    """The registry entry for ``name`` (a format object is returned as it is); refused and unknown
    names raise ValueError."""
    if isinstance(name, KVFormat):
        return name
    key = name.strip().lower() if isinstance(name, str) else name
    if key in _REFUSED:
        raise ValueError(_REFUSED[key])
    if key not in _FORMATS:
        raise ValueError(f"unknown kv_dtype {name!r}; valid: {', '.join(_FORMATS)}")
    return _FORMATS[key]
