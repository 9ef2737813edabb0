"""Where a CUDA split kernel's time goes, per block: a copy of csrc/paged_decode.cu stamps %globaltimer at
block start, before the main loop, at each warp's first data and loop end, and at block end.

    PYTHONPATH=$PWD python3 scripts/decode_timeline.py --out $OUT/decode_timeline.json

The stamps go to a buffer past mid_o (the probe's own), so the kernel's work is unchanged; its code is
not: adding the stamps moves the compiler's schedule, so absolute times can differ from the shipped
kernel by a few percent (the first-data stamp inside the loop once moved rk4v4-e8 D128's prologue from
2.5 to 4.6 us). Eager launches, each after the previous one finished, page sets rotated as in the bench.
Per case, medians over 20 calls of: span (first block start to last block end), prologue (start to the
loop), first data (start to a warp's first stage), loop (median / slowest block), a warp's last chunk (its last stage's
arrival to its loop end), the last stage's arrival and the last loop end over all blocks, the spread of warps
within a block, epilogue (a block's last warp to its end), the spread of block ends, and the SM clock the
blocks ran at. ``--burst N`` launches N calls back to back and keeps the last one's stamps: the card's clock
then is the one it runs the bench at, where a call alone may run at a lower one.

``--iters N`` also stamps each warp's first N iterations (SM clock) before and after its wait for the chunk,
and prints per iteration the medians (over warps, blocks and calls) of the wait and of the work after it, in
thousands of cycles:

    PYTHONPATH=$PWD python3 scripts/decode_timeline.py --ctx 131072,524288 --iters 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from decode_ab import program_from, use  # noqa: E402
from ninfer.bench.kernels import DecodeCase  # noqa: E402
from ninfer.kernels import cuda_build  # noqa: E402
from ninfer.kernels import paged_decode_cuda as pdc  # noqa: E402
from ninfer.kvcache.formats import get_format  # noqa: E402

SLOTS = 32  # uint64 per block: 0 start, 1 loop start, 2..9 warp loop ends, 12 end, 13 SM, 14 / 15 SM clock at
# start / end, 16..23 first data, 24..31 last data (each warp's last stage waited for)
STAMP = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"({}));'
CLOCK = 'asm volatile("mov.u64 %0, %%clock64;" : "=l"({}));'  # per iteration: SM cycles
EDITS = [  # (anchor in paged_decode.cu, text put before it, text put after it)
    ("  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;\n",
     "  unsigned long long T0, C0;\n  " + STAMP.format("T0") + "\n  " + CLOCK.format("C0") + "\n",
     "  unsigned long long* TS = reinterpret_cast<unsigned long long*>(mid_o + (size_t)gridDim.z * hq * num_splits"
     " * D) + 32 * ((size_t)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);\n"),
    ("  int use_stage = 0;\n",
     "  if (tid_all == 0) {\n    unsigned long long t1; unsigned smid;\n    " + STAMP.format("t1") +
     '\n    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));\n    TS[0] = T0; TS[1] = t1; TS[13] = smid; TS[14] = C0;\n  }\n', ""),
    ("    cp_wait<NST - 2>();\n    __syncwarp();\n", "",
     "    if ((it == 0 || it == my_n - 1) && lane == 0) {\n      unsigned long long tf;\n      " +
     STAMP.format("tf") + "\n      TS[(it == 0 ? 16 : 24) + warp] = tf;\n    }\n"),
    ("  cp_wait<0>();\n", "",
     "  if (lane == 0) {\n    unsigned long long t2;\n    " + STAMP.format("t2") + "\n    TS[2 + warp] = t2;\n  }\n"),
]


ITER_EDIT = (  # per iteration (lane 0, it < ND_ITERS): 2 stamps at TI[(block * NW + warp) * 2 ND_ITERS + 2 it]
    "    cp_wait<NST - 2>();\n    __syncwarp();\n",
    "    unsigned long long tw;\n    " + CLOCK.format("tw") + "\n",
    "    if (lane == 0 && it < ND_ITERS) {\n      unsigned long long ta;\n      " + CLOCK.format("ta") +
    "\n      unsigned long long* TI = reinterpret_cast<unsigned long long*>(mid_o + (size_t)gridDim.z * hq * "
    "num_splits * D) + 32 * (size_t)(gridDim.x * gridDim.y * gridDim.z) + ((size_t)((blockIdx.z * gridDim.y + "
    "blockIdx.y) * gridDim.x + blockIdx.x) * NW + warp) * 2 * ND_ITERS + 2 * it;\n      TI[0] = tw;\n"
    "      TI[1] = ta;\n    }\n")


def probe_source(dst: Path, iters: int = 0) -> None:
    for f in cuda_build.CSRC.iterdir():
        (dst / f.name).write_text(f.read_text())
    src = (dst / "paged_decode.cu").read_text()
    edits = EDITS
    if iters:  # the first/last-data stamps share the anchor: the per-iteration ones go first
        src = f"#define ND_ITERS {iters}\n" + src
        anchor, before, after = ITER_EDIT
        edits = [(a_, b_ + before, after + c_) if a_ == anchor else (a_, b_, c_) for a_, b_, c_ in EDITS]
    for anchor, before, after in edits:
        if src.count(anchor) != 1:
            raise SystemExit(f"decode_timeline: anchor not found once in paged_decode.cu: {anchor!r}")
        src = src.replace(anchor, before + anchor + after)
    # the block's end: after write_split returns (every thread), one more barrier, then the stamp
    call = "  write_split<D, NW, ROT>("
    if src.count(call) != 1:
        raise SystemExit(f"decode_timeline: {call!r} not found once in paged_decode.cu")
    call_end = src.index(";\n", src.index(call)) + 2
    src = src[:call_end] + ("  __syncthreads();\n  if (tid_all == 0) {\n    unsigned long long t3, c3;\n    " +
                            STAMP.format("t3") + "\n    " + CLOCK.format("c3") + "\n    TS[12] = t3; TS[15] = c3;\n"
                            "  }\n") + src[call_end:]
    (dst / "paged_decode.cu").write_text(src)


def iteration_medians(x: torch.Tensor) -> list[float | None]:
    """x [samples, iterations] in cycles, -1 where a sample did not run the iteration -> kcycles per column."""
    cols = (x[:, i][x[:, i] >= 0] for i in range(x.shape[1]))
    return [float(c.float().median()) / 1000 if c.numel() else None for c in cols]


def run_case(fmt: str, hq: int, hkv: int, d: int, ctx: int, calls: int, iters: int = 0, burst: int = 1) -> dict:
    c = DecodeCase(fmt, hq, hkv, d, ctx, 1)
    code = get_format(fmt).kernel_code
    cfg = pdc.default_cfg(code, d)
    nw = cfg[0]
    splits = pdc.cuda_num_splits(1, hkv, c.tables[0].shape[1], c.q.device, c.fmt, d, c.q.dtype, cfg)
    nb = splits * hkv
    ts_at = hq * splits * d  # float offsets in buf: mid_o, then SLOTS uint64 per block, then the iteration stamps
    ti_at = ts_at + nb * SLOTS * 2
    buf = torch.zeros(ti_at + nb * nw * 4 * iters, dtype=torch.float32, device="cuda")
    mid_o = buf[:ts_at].view(hq, splits, d)
    mid_lse = torch.empty(hq, splits, dtype=torch.float32, device="cuda")
    res, waits, works, clocks = [], [], [], []
    for i in range(calls + 4):
        for j in range(burst):  # back to back: the stamps are the last call's, made under load
            pdc._paged_decode_cuda_split(c.q, c.kp[0], c.kp[1], c.vp[0], c.vp[1], c.tables[(i + j) % c.sets],
                                         c.seq_lens, mid_o, mid_lse, code, c.scale, splits, cfg)
        torch.cuda.synchronize()
        if i < 4:  # warm-up
            continue
        ts = buf[ts_at:ti_at].view(torch.int64).view(nb, SLOTS).cpu()
        if iters:  # [block, warp, it, (before wait, after wait)]; 0 where a warp has fewer iterations
            ti = buf[ti_at:].view(torch.int64).view(nb, nw, iters, 2).cpu()
            have = ti[..., 0] > 0
            waits.append(torch.where(have, ti[..., 1] - ti[..., 0], -1))
            nxt = torch.cat([ti[:, :, 1:, 0], ti.new_zeros(nb, nw, 1)], 2)
            works.append(torch.where(have & (nxt > 0), nxt - ti[..., 1], -1))
            buf[ti_at:].zero_()
        t0 = ts[:, 0]
        base = int(t0.min())
        t0, t1, t3 = t0 - base, ts[:, 1] - base, ts[:, 12] - base
        t2, tf, tl = ts[:, 2:2 + nw] - base, ts[:, 16:16 + nw] - base, ts[:, 24:24 + nw] - base
        loop = t2.max(1).values - t1
        res.append({"span": int(t3.max()), "prologue": float((t1 - t0).float().median()),
                    "first_data": float((tf - t0[:, None]).float().median()),
                    "loop_median": float(loop.float().median()), "loop_slowest": int(loop.max()),
                    "last_chunk": float((t2 - tl).float().median()),
                    "data_end": int(tl.max()), "loop_end": int(t2.max()),
                    "warp_spread": float((t2.max(1).values - t2.min(1).values).float().median()),
                    "epilogue": float((t3 - t2.max(1).values).float().median()), "end_spread": int(t3.max() - t3.min())})
        clocks.append(float(((ts[:, 15] - ts[:, 14]).double() / (ts[:, 12] - ts[:, 0]).double()).median()))
    out = {k: statistics.median(r[k] for r in res) / 1000 for k in res[0]}  # ns -> us
    out["sm_clock_ghz"] = statistics.median(clocks)  # SM cycles per ns of a block's span: the clock it ran at
    if iters:  # per iteration: medians over (call, block, warp) of those that ran it
        out["iter_wait_kcycles"] = iteration_medians(torch.stack(waits).flatten(0, 2))
        out["iter_work_kcycles"] = iteration_medians(torch.stack(works).flatten(0, 2))
    return {"format": fmt, "geometry": f"{hq}q/{hkv}kv/D{d}", "ctx": ctx, "splits": splits, "blocks": nb, **out}


def geometries(text: str) -> list[tuple[int, ...]]:
    """argparse type: "HQ,HKV,D;..." (decode_probe's int_list for each)."""
    from decode_probe import int_list
    return [int_list(3)(g) for g in text.split(";")]


def non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return n


def positive(text: str) -> int:
    n = non_negative(text)
    if n == 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="int8,rk4v4-e8")
    p.add_argument("--ctx", default="32768,131072")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--geometries", default="32,8,128;24,4,256", type=geometries,
                   help='";"-separated q heads,kv heads,head dim')
    p.add_argument("--iters", type=non_negative, default=0, help="also time each warp's first N iterations")
    p.add_argument("--burst", type=positive, default=1,
                   help="launch this many calls back to back and keep the last one's stamps (the card under load; "
                        "1: each call alone)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        probe_source(Path(tmp), a.iters)
        use(program_from(Path(tmp)))
        rows = [run_case(f, hq, hkv, d, int(ctx), a.calls, a.iters, a.burst) for hq, hkv, d in a.geometries
                for f in a.formats.split(",") for ctx in a.ctx.split(",")]
    keys = ["span", "prologue", "first_data", "loop_median", "loop_slowest", "last_chunk", "data_end", "loop_end",
            "warp_spread", "epilogue", "end_spread", "sm_clock_ghz"]
    print("| geometry | format | ctx | blocks | " + " | ".join(keys) + " |")
    print("|---|---|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['geometry']} | {r['format']} | {r['ctx'] // 1024}K | {r['blocks']} | " +
              " | ".join(f"{r[k]:.2f}" for k in keys) + " |")
    for r in rows if a.iters else []:
        print(f"{r['geometry']} {r['format']} {r['ctx'] // 1024}K, per iteration (kcycles), wait / work:")
        print("  " + " ".join(f"{i}:{wt:.2f}/{wk:.2f}" for i, (wt, wk) in
                              enumerate(zip(r["iter_wait_kcycles"], r["iter_work_kcycles"]))
                              if wt is not None and wk is not None))
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                                           "unit": "us", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
