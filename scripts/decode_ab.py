"""The CUDA decode kernel against another version of its source, side by side on one GPU.

    git show REV:ninfer/kernels/csrc/paged_decode.cu > OLD/paged_decode.cu   # and decode_ops.cuh
    PYTHONPATH=$PWD python3 scripts/decode_ab.py --old OLD --out $OUT/decode_ab.json
    PYTHONPATH=$PWD python3 scripts/decode_ab.py --old OLD --new NEW     # two variants, neither shipped
    PYTHONPATH=$PWD python3 scripts/decode_ab.py --old OLD --new A,B,C --formats rk4v4-e8   # several at once

Both sources are built with the same defines and launched through the same wrapper (the kernel's
signature must match). Per case (format, geometry, context, batch; random valid pages), each
kernel is checked against the float64 oracle, then timed as CUDA-graph replays in ABBA rounds
(the card's speed drifts over minutes; with several new sources each round runs them all, in
alternating order); the table gives medians and each / old. Like the kernel
bench, the calls of a replay rotate over page sets that together exceed the L2 four times, so no
call finds the previous one's pages there (``--sets 1`` was this script's timing until stop 20).
Sources older than the wrapper: ``--old-vpad`` (before stop 20: padded D128 V rows) and
``--old-h64`` (before stop 21: rotated partials left in the H64 domain for the merge to rotate).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from decode_probe import prebuild  # noqa: E402
from ninfer.bench.kernels import DecodeCase, time_graph  # noqa: E402
from ninfer.kernels.decode_reduce import decode_reduce  # noqa: E402
from ninfer.kernels import paged_decode as pd  # noqa: E402
from ninfer.kernels import paged_decode_cuda as pdc  # noqa: E402


def program_from(src_dir: Path) -> pdc._CudaDecode:
    return pdc._CudaDecode(src_dir)


def use(prog) -> None:
    pdc._CUDA = prog
    pd._CUDA = prog
    # a source from before stop 21 leaves rotated formats' partials in the H64 domain for the merge
    pd.decode_reduce = getattr(prog, "merge", decode_reduce)


def h64_merge(fmt_rotated: bool):
    return lambda mid_o, mid_lse, out, rotated=False: decode_reduce(mid_o, mid_lse, out, rotated=fmt_rotated)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="directory with the old paged_decode.cu and decode_ops.cuh")
    p.add_argument("--new", default=None,
                   help="the same for the new one (default: the package's csrc/); comma-separated for several")
    p.add_argument("--formats", default="int8,rk4v4,rk4v4-e8")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cases", default="32768:1,131072:1,131072:8", help="context:batch pairs")
    p.add_argument("--sets", type=int, default=0,
                   help="page sets the replays rotate over (0: as the kernel bench, enough to defeat the L2)")
    p.add_argument("--old-vpad", action="store_true",
                   help="the old source pads 4-bit D128 V rows to 80 bytes (before stop 20): size stages for it")
    p.add_argument("--old-h64", action="store_true",
                   help="the old source writes rotated partials in the H64 domain (before stop 21): merge with rotation")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.old_vpad:  # both kernels get the padded size; neither needs more blocks per SM than it allows
        size = pdc._cuda_smem_bytes
        pdc._cuda_smem_bytes = lambda key: size(key) + (key[3] * key[5] * key[4] * 16 if key[0] != 1 and key[1] == 128
                                                        and key[5] == 2 else 0)
    news = a.new.split(",") if a.new else []
    progs = {"old": program_from(Path(a.old))}
    if len(news) <= 1:
        progs["new"] = program_from(Path(news[0])) if news else pdc._CUDA
    else:
        progs.update((Path(n).name, program_from(Path(n))) for n in news)
    formats = a.formats.split(",")
    prebuild(formats, (128, 256), (None,), progs.values())
    cases = [(f, g, ctx, b) for g in ((32, 8, 128), (24, 4, 256)) for f in formats
             for ctx, b in (tuple(int(x) for x in cb.split(":")) for cb in a.cases.split(","))]
    rows = []
    for fmt, (hq, hkv, d), ctx, bsz in cases:
        c = DecodeCase(fmt, hq, hkv, d, ctx, bsz, a.sets)
        if a.old_h64:
            progs["old"].merge = h64_merge(c.fmt.rotated)

        def call(i=0):
            return pd.paged_decode_cuda(c.q, c.kp, c.vp, c.tables[i], c.seq_lens, c.fmt, c.scale, out=c.outs[i])
        calls = [lambda i=i: call(i) for i in range(c.sets)] * max(1, 10 // c.sets)
        ref = pd.paged_decode_ref(c.q, c.kp, c.vp, c.tables[0], c.seq_lens, c.fmt, c.scale)
        row = {"format": fmt, "geometry": f"{hq}q/{hkv}kv/D{d}", "ctx": ctx, "batch": bsz, "sets": c.sets}
        for name, prog in progs.items():
            use(prog)
            c.outs[0].fill_(float("nan"))
            call()
            row[f"rel_err_{name}"] = float((c.outs[0].double() - ref).norm() / ref.norm())
        times = {name: [] for name in progs}
        for r in range(a.rounds):
            for name in (list(progs) if r % 2 == 0 else list(progs)[::-1]):
                use(progs[name])
                times[name].append(time_graph(calls, 60))
        use(progs[list(progs)[-1]])
        row.update({f"us_{k}": statistics.median(v) for k, v in times.items()}, runs=times)
        for name in list(progs)[1:]:
            row[f"{name}_over_old"] = row[f"us_{name}"] / row["us_old"]
        rows.append(row)
        print(f"{fmt:9s} {row['geometry']:13s} ctx={ctx:6d} B={bsz}  old {row['us_old']:8.2f} us  " + "  ".join(
            f"{n} {row[f'us_{n}']:8.2f} us ({row[f'{n}_over_old']:.3f}, err {row[f'rel_err_{n}']:.2e})"
            for n in list(progs)[1:]) + f"  old err {row['rel_err_old']:.2e}", flush=True)
        c = ref = None  # free the pool before the next case
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
