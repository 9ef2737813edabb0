"""The CUDA 4-bit store, two kernel sources side by side on one GPU: the package's csrc/ (new)
and a directory holding another store_kv.cu + kv_encode.cuh (old), or two such directories.

Per format (rk4v4, rk4v4-e8), geometry (4kv/D256, 8kv/D128) and token count: the new kernel's
planes are compared byte for byte with the Triton store and with the torch reference encoder
(``fmt.encode``), then old and new are timed in ABBA rounds as CUDA-graph replays over distinct
inputs (``bench_store_prefill.graph_store_us``); the median of the new/old ratios is reported.
16384 tokens runs the thread-per-group kernel, 8 the lane-per-word one (a decode step).

    PYTHONPATH=$PWD python3 scripts/store_ab.py --old ab_old [--new DIR] --out $OUT/store_ab.json

``--profile``: 16384 tokens of one format, 8 kv heads, D128, stored three times (for Nsight Compute).
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
from ninfer.bench.kernels import copy_bandwidth  # noqa: E402
from ninfer.kernels import store_kv_cuda as sc  # noqa: E402
from ninfer.kernels.cuda_build import CudaProgram  # noqa: E402
from ninfer.kernels.store_kv import store_kv_triton  # noqa: E402


def program(src: str | None) -> CudaProgram:
    p = CudaProgram("store_kv.cu", ("rtc_compat.cuh", "kv_encode.cuh"), "kv_store")
    if src:
        p.files = {n: (Path(src) / n).read_text() for n in p.files}
        p.source = "".join(p.files.values())
    return p


def run_store(prog, fmt, k, v, planes, slots):
    saved, sc._STORE = sc._STORE, prog
    try:
        sc.launch_store_kv_cuda(k, v, planes["k"].view(torch.int32), planes["k_scale"], planes["v"].view(torch.int32),
                                planes["v_scale"], slots, fmt.kernel_code, float(fmt.scale_divisor), b.PAGE)
    finally:
        sc._STORE = saved


def planes_bytes(planes):
    return torch.cat([p.view(torch.uint8).flatten() for p in planes.values()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", default="16384,8")
    ap.add_argument("--formats", default="rk4v4-e8,rk4v4")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="only store the first format's first case three times with the package's kernel "
                         "(a target for ncu --launch-skip 1 --launch-count 1)")
    a = ap.parse_args()
    if a.profile:
        gen = torch.Generator(device="cuda").manual_seed(0)
        name = a.formats.split(",")[0]
        _fmt, k, v, slots, newp = b.store_inputs(name, 8, 128, int(a.tokens.split(",")[0]), gen, "pages")
        planes = newp()
        for _ in range(3):
            sc.store_kv_cuda(k, v, planes, slots, _fmt)
        torch.cuda.synchronize()
        return
    progs = {"old": program(a.old), "new": program(a.new)}
    bw = copy_bandwidth(100)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in a.formats.split(","):
        for hkv, d in ((4, 256), (8, 128)):
            for tokens in (int(t) for t in a.tokens.split(",")):
                fmt, k, v, slots, newp = b.store_inputs(name, hkv, d, tokens, gen, "pages")
                tri = newp()
                store_kv_triton(k, v, tri, slots, fmt)
                got = newp()
                run_store(progs["new"], fmt, k, v, got, slots)
                torch.cuda.synchronize()
                bad_triton = (planes_bytes(got) != planes_bytes(tri)).float().mean().item()
                pg, off = slots // b.PAGE, slots % b.PAGE
                bad_ref = 0.0
                for which, x in (("k", k), ("v", v)):
                    data, s16 = fmt.encode(x)
                    bad_ref += (got[which][pg, :, off].view(torch.uint8) != data.view(torch.uint8)).float().mean().item() / 2
                    bad_ref += (got[f"{which}_scale"][pg, :, off] != s16).float().mean().item() / 2
                nbytes = 2 * tokens * hkv * d * 2 + tokens * hkv * fmt.bytes_per_token_head(d, torch.bfloat16) + tokens * 8
                us = {"old": [], "new": []}
                for r in range(a.rounds):
                    for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                        pl = newp()
                        us[which].append(b.graph_store_us(k, v, slots, pl, lambda kk, vv, pp, ss, w=which:
                                                          run_store(progs[w], fmt, kk, vv, pp, ss), gen))
                ratio = statistics.median(n / o for n, o in zip(us["new"], us["old"]))
                row = {"format": name, "hkv": hkv, "d": d, "tokens": tokens, "bad_vs_triton": bad_triton,
                       "bad_vs_reference": bad_ref, "us_old": statistics.median(us["old"]),
                       "us_new": statistics.median(us["new"]), "new_over_old": ratio,
                       "pct_copy_old": 100 * nbytes / (statistics.median(us["old"]) * 1e-6) / bw,
                       "pct_copy_new": 100 * nbytes / (statistics.median(us["new"]) * 1e-6) / bw, "raw": us}
                rows.append(row)
                print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "raw"}), flush=True)
    print(f"\n{'format':9} {'geom':9} {'tokens':>6} {'old us':>8} {'new us':>8} {'new/old':>7} "
          f"{'%copy old':>9} {'%copy new':>9} {'bad/tri':>8} {'bad/ref':>8}")
    for r in rows:
        print(f"{r['format']:9} {r['hkv']}kv/D{r['d']:<4} {r['tokens']:>6} {r['us_old']:8.1f} {r['us_new']:8.1f} "
              f"{r['new_over_old']:7.3f} {r['pct_copy_old']:9.1f} {r['pct_copy_new']:9.1f} "
              f"{r['bad_vs_triton']:8.1e} {r['bad_vs_reference']:8.1e}")
    if a.out:
        Path(a.out).write_text(json.dumps({"copy_bw": bw, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
