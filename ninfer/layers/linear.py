"""Linears and embeddings split over the tensor-parallel group (ninfer/distributed/parallel_state.py).

* `MergedLinear` (column-parallel): several checkpoint linears run as one matmul (q|k|v, gate|up,
  the GDN in_proj); each rank holds its share of every block of rows, so q|k|v is split by heads.
* `RowParallelLinear`: the input features are split; one all_reduce sums the partial products and
  the bias is added once, after it.
* `VocabParallelEmbedding` / `ParallelLMHead`: each rank holds ceil(V / N) vocabulary rows; the
  embedding masks ids outside its rows and all_reduces, the logits are all_gathered by the model.

Every module lists in `tp_shards` how its parameters cut a checkpoint tensor: {param: (dim, blocks)}
with `blocks` the global sizes of the consecutive blocks along `dim`; each block is split in N equal
chunks and rank r holds chunk r of each, in block order (`shard_pieces`). With one rank nothing is
split and every layer is the plain torch module."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.distributed import parallel_state as ps


def shard_pieces(blocks: tuple[int, ...], rank: int, size: int) -> list[tuple[int, int, int]]:
    """(checkpoint offset, local offset, length) of rank's chunk of each block. A block that `size`
    does not divide (the vocabulary) gets ceil(block / size) local rows, the last rank fewer real ones."""
    out, src, dst = [], 0, 0
    for b in blocks:
        chunk = -(-b // size)
        start = min(rank * chunk, b)
        n = min(chunk, b - start)
        if n > 0:
            out.append((src + start, dst, n))
        src, dst = src + b, dst + chunk
    return out


def local_size(blocks: tuple[int, ...], size: int) -> int:
    return sum(-(-b // size) for b in blocks)


def _blocks(n: int | tuple[int, ...]) -> tuple[int, ...]:
    return (n,) if isinstance(n, int) else tuple(n)


class MergedLinear(nn.Linear):
    """One linear whose output rows are the concatenation of several checkpoint linears, column-
    parallel. `parts` = ((checkpoint module name, rows or (block rows, ...)), ...), global sizes in
    row order; a part of several blocks (the GDN q|k|v) is split block by block."""

    def __init__(self, in_features: int, parts: tuple[tuple[str, int | tuple[int, ...]], ...], bias: bool) -> None:
        size = ps.tp_size()
        for name, n in parts:
            if any(b % size for b in _blocks(n)):
                raise ValueError(f"tensor-parallel-size {size} does not divide the rows {n} of {name}")
        super().__init__(in_features, sum(local_size(_blocks(n), size) for _, n in parts), bias=bias)
        self.parts = tuple((name, _blocks(n)) for name, n in parts)

    def part_pieces(self) -> dict[str, tuple[int, list[tuple[int, int, int]]]]:
        """checkpoint module name -> (its global rows, [(checkpoint row, parameter row, rows), ...])."""
        out, start = {}, 0
        rank, size = ps.tp_rank(), ps.tp_size()
        for name, blocks in self.parts:
            out[name] = (sum(blocks), [(s, start + d, n) for s, d, n in shard_pieces(blocks, rank, size)])
            start += local_size(blocks, size)
        return out


class RowParallelLinear(nn.Linear):
    """A linear over input features split across ranks (o_proj, down_proj, out_proj): each rank's
    partial product, one all_reduce, then the (whole, replicated) bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        size = ps.tp_size()
        if in_features % size:
            raise ValueError(f"tensor-parallel-size {size} does not divide the {in_features} input features")
        super().__init__(in_features // size, out_features, bias=bias)
        self.tp_shards = {"weight": (1, (in_features,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ps.tp_size() == 1:
            return super().forward(x)
        y = ps.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows vocab_start .. vocab_start + ceil(V / N) of the embedding; other ids embed to zero here
    and are filled in by their rank through the all_reduce."""

    def __init__(self, vocab: int, hidden: int) -> None:
        size = ps.tp_size()
        rows = -(-vocab // size)
        super().__init__(rows, hidden)
        self.vocab, self.vocab_start = vocab, ps.tp_rank() * rows
        self.tp_shards = {"weight": (0, (vocab,))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ps.tp_size() == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return ps.all_reduce(out)


class ParallelLMHead(nn.Linear):
    """This rank's ceil(V / N) vocabulary rows of the output projection (the embedding's when tied);
    `gather_logits` assembles the full vocabulary."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__(hidden, -(-vocab // ps.tp_size()), bias=False)
        self.vocab = vocab
        self.tp_shards = {"weight": (0, (vocab,))}

    def gather_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 on every rank (rank order is vocabulary order; padding dropped)."""
        logits = self.forward(hidden).float()
        if ps.tp_size() == 1:
            return logits
        return ps.all_gather(logits, dim=-1)[:, :self.vocab]
