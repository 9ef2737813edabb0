"""Swap the model's linears for QuantLinear where the checkpoint stores them quantized, before the
weights are allocated (on the meta device), and finish them once the weights are loaded."""
from __future__ import annotations

from typing import Collection

from torch import nn

from ninfer.layers.linear import MergedLinear
from ninfer.quant.config import QuantConfig, QuantConfigError
from ninfer.quant.linear import QuantLinear


def quantize_modules(model: nn.Module, qc: QuantConfig, present: Collection[str] | None = None) -> int:
    """Replace every nn.Linear / MergedLinear that has a quantized checkpoint part; returns how many.
    Parts are named as the checkpoint names them (`checkpoint_map`), which is what ignore lists match.
    `present` (the checkpoint's tensor names) overrides the config where they disagree: a part whose
    scale tensor is absent but whose dense weight is there (an lm_head a config forgot to exclude)
    loads dense, and a part with a scale tensor loads quantized."""
    from ninfer.distributed import parallel_state as ps
    if ps.tp_size() > 1:  # QuantLinear holds whole tensors; sharding its packed rows and scales is not built
        raise QuantConfigError(f"quantized weights ({qc.name}) do not load with tensor parallelism yet "
                               f"(tensor-parallel size {ps.tp_size()}); run them on one GPU")
    _, scale, _ = qc.tensor_names()

    def quantized(ck: str) -> bool:
        if present is None:
            return qc.is_quantized(ck)
        if f"{ck}.{scale}" in present:
            return True
        if f"{ck}.weight" in present:  # a weight without its scale is dense
            return False
        return qc.is_quantized(ck)  # neither: the loader names what is missing

    parts_of: dict[str, list[tuple[int, str]]] = {}
    for ck, t in model.checkpoint_map().items():
        if ck.endswith(".weight") and t.param.endswith(".weight"):
            start = min(dst for _, dst, _ in t.pieces) if t.pieces else 0  # the part's first row
            parts_of.setdefault(t.param[: -len(".weight")], []).append((start, ck[: -len(".weight")]))
    replaced = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or name not in parts_of:
            continue  # a tied lm_head is the embedding, not listed
        cks = [ck for _, ck in sorted(parts_of[name])]
        flags = [quantized(ck) for ck in cks]
        if not any(flags):
            continue
        layout = tuple((n, sum(b)) for n, b in mod.parts) if isinstance(mod, MergedLinear) else \
            (("", mod.out_features),)
        parts = tuple((n, r, f) for (n, r), f in zip(layout, flags))
        new = QuantLinear(qc, mod.in_features, parts, mod.bias is not None, mod.weight.dtype, where=cks[0])
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        replaced += 1
    return replaced


def finalize(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.finalize()


def describe(model: nn.Module, qc: QuantConfig) -> str:
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    nbytes = sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
    impls = sorted({m.impl for m in mods})
    return (f"quantized weights: {qc.name}, {len(mods)} linears, {nbytes / 2**30:.3f} GiB, "
            f"impl={'/'.join(impls) or '-'}")
