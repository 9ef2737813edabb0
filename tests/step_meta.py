"""Step metadata for kernel and backend tests: new tokens at the end of each sequence, its pages
given as a list per sequence (what the scheduler and runner would build)."""
from __future__ import annotations


def make_meta(qlens, seq_lens, tables, width, page):
    import torch

    from ninfer.attention.base import AttentionMetadata

    slots = []
    for n, total, pages in zip(qlens, seq_lens, tables):
        slots += [pages[p // page] * page + p % page for p in range(total - n, total)]
    bt = torch.full((len(qlens), width), -1, dtype=torch.int32)
    for i, pages in enumerate(tables):
        bt[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
        max_query_len=max(qlens), max_seq_len=max(seq_lens), is_decode=all(n == 1 for n in qlens),
        query_lens_cpu=list(qlens), seq_lens_cpu=list(seq_lens))
