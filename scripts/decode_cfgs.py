"""CUDA decode kernel configurations side by side, timed as ``ninfer bench kernels`` times decode.

    PYTHONPATH=$PWD python3 scripts/decode_cfgs.py --cfgs "8,32,2,2;8,32,3,2" --formats rk4v4-e8 --out $OUT/cfgs.json

A configuration is (warps, tokens per chunk, pipeline stages, min blocks per SM); "dflt" is the
default for the format and head dim (``default_cfg``). Per (format, geometry): one pool of page
sets at least 4x the L2 size (every call reads from HBM, as in the kernel bench), each
configuration checked against the float64 oracle, then timed as CUDA-graph replays in rounds of
alternating order; the table gives medians and the ratio to the first configuration.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.bench.kernels import bench_decode_format, copy_bandwidth  # noqa: E402


def parse_cfg(text: str):
    return None if text == "dflt" else tuple(int(x) for x in text.split(","))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cfgs", required=True, help='";"-separated, e.g. "dflt;8,32,3,2"')
    p.add_argument("--formats", default="int8,rk4v4,rk4v4-e8")
    p.add_argument("--geometries", default="24,4,256;32,8,128")
    p.add_argument("--ctx", default="131072", help="comma list")
    p.add_argument("--batch", default="1", help="comma list")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cfgs = [c.strip() for c in a.cfgs.split(";")]
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
    bw = copy_bandwidth(a.rep_ms)
    rows = []
    shapes = [(g, f, int(c), int(b)) for g in a.geometries.split(";") for f in a.formats.split(",")
              for c in a.ctx.split(",") for b in a.batch.split(",")]
    for geom, fmt, ctx, bsz in shapes:
        hq, hkv, d = (int(x) for x in geom.split(","))
        case, times, errs = None, {c: [] for c in cfgs}, {}
        for r in range(a.rounds):
            for c in (cfgs if r % 2 == 0 else cfgs[::-1]):
                extra = {} if parse_cfg(c) is None else {"cuda_cfg": parse_cfg(c)}
                row, case = bench_decode_format(fmt, "cuda", hq, hkv, d, ctx, bsz, l2, a.rep_ms, bw,
                                                extra, case)
                if "us" not in row:
                    errs[c] = row.get("error", "?")
                    continue
                times[c].append(row["us"])
        base = statistics.median(times[cfgs[0]]) if times[cfgs[0]] else float("nan")
        for c in cfgs:
            us = statistics.median(times[c]) if times[c] else float("nan")
            rows.append({"format": fmt, "geometry": f"{hq}q/{hkv}kv/D{d}", "ctx": ctx, "batch": bsz,
                         "cfg": c, "us": us, "runs": times[c], "over_first": us / base, "error": errs.get(c)})
            print(f"{fmt:9s} {hq}q/{hkv}kv/D{d:<4d} {ctx:6d} B{bsz} cfg={c:10s} {us:8.2f} us  x{us / base:.3f}"
                  + (f"  ERROR {errs[c]}" if c in errs else ""), flush=True)
        case = None
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": props.name, "copy_bw": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
