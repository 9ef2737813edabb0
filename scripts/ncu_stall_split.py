"""Where a kernel's warps stall: Nsight Compute's source-level samples split into the part before
the main loop, the loop and the part after it, with the top stall reasons of each.

    ncu --set full --import-source no --kernel-name nd_decode --launch-skip 2 --launch-count 1 -o rep \\
        python3 scripts/decode_probe.py --only rk4v4-e8 --calls 4 --ctx 131072
    ncu -i rep.ncu-rep --page source --csv --print-source sass > e8.csv
    python3 scripts/ncu_stall_split.py e8.csv [--top pre|loop|post] [--by-opcode math]

The loop is the smallest backward-branch range of more than 100 instructions that holds an HMMA
(as in decode_sass.py). Runs anywhere (the CSV is plain text; .gz is read too).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_sass import opcode  # noqa: E402


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    hdr = next((r for r in rows if "Address" in r and "Source" in r), None)
    if hdr is None:
        raise SystemExit(f"{path}: no 'Address'/'Source' header: not an `ncu --page source --csv` export")
    return hdr, [r for r in rows[rows.index(hdr) + 1:] if len(r) == len(hdr)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--top", choices=("pre", "loop", "post"), default=None, help="list that part's hottest lines")
    p.add_argument("--by-opcode", default=None, metavar="REASON",
                   help="the loop's samples of one stall reason (math, wait, dispatch, ...) per opcode")
    a = p.parse_args()
    hdr, data = read_rows(a.csv)
    ix = {h: i for i, h in enumerate(hdr)}

    def val(r, h) -> float:
        try:
            return float(r[ix[h]] or 0)
        except ValueError:
            return 0.0
    addr = [int(r[ix["Address"]], 16) for r in data]
    src = [r[ix["Source"]] for r in data]
    pos = {a_: i for i, a_ in enumerate(addr)}
    loop = None
    for i, s in enumerate(src):
        m = re.search(r"BRA (0x[0-9a-f]+)", s)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in pos:
            j = pos[int(m.group(1), 16)]
            if any("HMMA" in b for b in src[j:i + 1]) and i + 1 - j > 100 and (loop is None or i + 1 - j < loop[1] - loop[0]):
                loop = (j, i + 1)
    if loop is None:
        print("no main loop found", file=sys.stderr)
        return 1
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    if a.by_opcode is not None and f"stall_{a.by_opcode}" not in stalls:
        raise SystemExit(f"--by-opcode: no stall reason {a.by_opcode!r}; known: "
                         + ", ".join(h[6:] for h in stalls))
    total = sum(val(r, h) for r in data for h in stalls) or 1.0
    parts = {"pre": range(0, loop[0]), "loop": range(*loop), "post": range(loop[1], len(data))}
    print(f"main loop: {loop[1] - loop[0]} instructions")
    for name, rng in parts.items():
        c = collections.Counter()
        for i in rng:
            for h in stalls:
                c[h[6:]] += val(data[i], h)
        n = sum(c.values())
        print(f"{name:5s} {len(rng):5d} instr  {n:7.0f} samples ({100 * n / total:5.1f}%)  "
              + " ".join(f"{k}:{v:.0f}" for k, v in c.most_common(6)))
    if a.by_opcode:
        c, n_op = collections.Counter(), collections.Counter()
        for i in range(*loop):
            op = opcode(src[i])
            c[op] += val(data[i], f"stall_{a.by_opcode}")
            n_op[op] += 1
        n = sum(c.values()) or 1.0
        print(f"loop, {a.by_opcode} stalls by opcode (samples, share, per instruction of that opcode):")
        for op, v in c.most_common(12):
            print(f"  {op:8s} {v:6.0f} {100 * v / n:5.1f}%  {v / n_op[op]:5.2f}  ({n_op[op]} instr)")
    if a.top:
        rng = parts[a.top]
        for i in sorted(sorted(rng, key=lambda i: -val(data[i], "Warp Stall Sampling (All Samples)"))[:25]):
            top = sorted(((val(data[i], h), h[6:]) for h in stalls), reverse=True)[:2]
            print(f"{i:5d} {val(data[i], 'Warp Stall Sampling (All Samples)'):6.0f}  {src[i][:64]:64s} "
                  + " ".join(f"{k}:{v:.0f}" for v, k in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
