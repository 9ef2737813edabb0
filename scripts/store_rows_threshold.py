"""Where the CUDA 4-bit store should switch from eight lanes per 64-group (kv_store) to one thread
per group (kv_store_rows): both kernels timed at several token counts, side by side, as CUDA-graph
replays over distinct inputs (``bench_store_prefill.graph_store_us``), ABBA rounds; each kernel's
bytes compared with the Triton store first. Sets ``store_kv_cuda.ROWS_MIN_GROUPS`` per call.

    PYTHONPATH=$PWD python3 scripts/store_rows_threshold.py --out $OUT/store_rows_threshold.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_store_prefill as b  # noqa: E402
from store_ab import planes_bytes  # noqa: E402
from ninfer.kernels import store_kv_cuda as sc  # noqa: E402
from ninfer.kernels.store_kv import store_kv_triton  # noqa: E402

KERNELS = {"lanes": 1 << 30, "rows": 1}  # ROWS_MIN_GROUPS that forces each kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,16,32,64,128,256,1024")
    ap.add_argument("--formats", default="rk4v4-e8,rk4v4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    default = sc.ROWS_MIN_GROUPS
    rows = []
    for name in a.formats.split(","):
        for tokens in (int(t) for t in a.tokens.split(",")):
            fmt, k, v, slots, newp = b.store_inputs(name, 8, 128, tokens, gen, "pages")
            tri = newp()
            store_kv_triton(k, v, tri, slots, fmt)
            ref = planes_bytes(tri)

            def store(kk, vv, planes, ss, kern):
                sc.ROWS_MIN_GROUPS = KERNELS[kern]
                sc.store_kv_cuda(kk, vv, planes, ss, fmt)
            bad = {}
            for kern in KERNELS:
                pl = newp()
                store(k, v, pl, slots, kern)
                torch.cuda.synchronize()
                bad[kern] = (planes_bytes(pl) != ref).float().mean().item()
            us = {kern: [] for kern in KERNELS}
            for r in range(a.rounds):
                for kern in (("lanes", "rows") if r % 2 == 0 else ("rows", "lanes")):
                    us[kern].append(b.graph_store_us(k, v, slots, newp(),
                                                     lambda kk, vv, pp, ss, kern=kern: store(kk, vv, pp, ss, kern), gen))
            sc.ROWS_MIN_GROUPS = default
            row = {"format": name, "hkv": 8, "d": 128, "tokens": tokens, "bad_vs_triton": bad,
                   "us_lanes": statistics.median(us["lanes"]), "us_rows": statistics.median(us["rows"]), "raw": us}
            rows.append(row)
            print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "raw"}), flush=True)
    print(f"\n{'format':9} {'tokens':>6} {'lanes us':>9} {'rows us':>8} {'rows/lanes':>10}")
    for r in rows:
        print(f"{r['format']:9} {r['tokens']:>6} {r['us_lanes']:9.2f} {r['us_rows']:8.2f} {r['us_rows'] / r['us_lanes']:10.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "default_rows_min_tokens": default,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
