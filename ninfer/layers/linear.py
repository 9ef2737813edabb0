"""Merged linears: q|k|v and gate|up run as one matmul; the loader fills their row blocks from the
checkpoint's separate tensors (`part_rows`)."""
from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """One linear whose output rows are the concatenation of several checkpoint linears.
    `parts` = ((checkpoint module name, rows), ...), in row order."""

    def __init__(self, in_features: int, parts: tuple[tuple[str, int], ...], bias: bool) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=bias)
        self.parts = parts

    def part_rows(self) -> dict[str, tuple[int, int]]:
        """checkpoint module name -> (first row, rows)."""
        out, start = {}, 0
        for name, n in self.parts:
            out[name] = (start, n)
            start += n
        return out
