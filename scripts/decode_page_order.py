"""Does the order of a sequence's pages in the pool change decode time? The CUDA decode kernel per
format at 128K tokens, batch 1, with the kernel bench's random page order and with the same pages
sorted (each sequence's pages contiguous in the pool), timed as CUDA-graph replays in alternating
rounds (medians). Run on a CUDA machine:

    PYTHONPATH=$PWD python3 scripts/decode_page_order.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.bench.kernels import DecodeCase, time_graph  # noqa: E402
from ninfer.kernels import paged_decode as pd  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for hq, hkv, d in ((32, 8, 128), (24, 4, 256)):
        for fmt in ("int8", "rk4v4", "rk4v4-e8"):
            c = DecodeCase(fmt, hq, hkv, d, a.ctx, 1, l2_bytes=l2)  # page sets as the kernel bench sizes them
            sets = c.sets
            tables = {"random": c.tables, "sorted": [t.sort(dim=1).values.contiguous() for t in c.tables]}

            def calls(order):
                return [lambda i=i: pd.paged_decode_cuda(c.q, c.kp, c.vp, tables[order][i], c.seq_lens, c.fmt,
                                                         c.scale, out=c.outs[i]) for i in range(sets)]
            us = {"random": [], "sorted": []}
            for r in range(a.rounds):
                for order in (("random", "sorted") if r % 2 == 0 else ("sorted", "random")):
                    us[order].append(time_graph(calls(order), 60))
            row = {"format": fmt, "geometry": f"{hq}q/{hkv}kv/D{d}", "ctx": a.ctx, "sets": sets,
                   "us_random": statistics.median(us["random"]), "us_sorted": statistics.median(us["sorted"])}
            row["sorted_over_random"] = row["us_sorted"] / row["us_random"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
