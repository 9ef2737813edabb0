"""Registers and main-loop SASS of the CUDA decode kernel, without a GPU: nvcc compiles
ninfer/kernels/csrc/paged_decode.cu for sm_90 (the engine's flags), Triton's bundled cuobjdump
disassembles it, and the innermost loop that contains the MMAs is counted by opcode.

    python3 scripts/decode_sass.py                       # int8 / rk4v4 / rk4v4-e8 at D 128 and 256
    python3 scripts/decode_sass.py --src old.cu --fmt rk4v4-e8 --d 128

Instruction counts are per warp per pipeline chunk (its size is in the printed cfg, the second field).
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main_loop(sass: str) -> list[str]:
    """The smallest backward-branch range (> 100 instructions) that holds an HMMA."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = None
    for addr, text in ins:
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any("HMMA" in t for t in body) and len(body) > 100 and (best is None or len(body) < len(best)):
                best = body
    return best or []


def opcode(text: str) -> str:
    words = text.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0]


def report(src: Path, fmt_c: int, d: int, cfg: tuple) -> str:
    import triton
    nw, chunk, nst, minb = cfg
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cmd = ["nvcc", "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-Xptxas", "-v", "-o", str(cubin), str(src),
               f"-DND_FMT={fmt_c}", f"-DND_D={d}", f"-DND_NW={nw}", f"-DND_CHUNK={chunk}", f"-DND_NST={nst}",
               f"-DND_MINB={minb}", "-DND_QT=__nv_bfloat16"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        regs = re.search(r"Used (\d+) registers", res.stderr)
        spill = re.search(r"(\d+) bytes spill stores", res.stderr)
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    loop = main_loop(sass)
    hist = collections.Counter(opcode(t) for t in loop)
    top = " ".join(f"{k}:{v}" for k, v in hist.most_common(12))
    return (f"regs={regs.group(1) if regs else '?'} spill={spill.group(1) if spill else '?'}B "
            f"loop={len(loop)}  {top}")


def main() -> int:
    from decode_probe import int_list
    from ninfer.kernels.paged_decode_cuda import _key
    from ninfer.kvcache.formats import get_format
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", default=str(ROOT / "ninfer" / "kernels" / "csrc" / "paged_decode.cu"))
    p.add_argument("--fmt", default="int8,rk4v4,rk4v4-e8")
    p.add_argument("--d", default="128,256")
    p.add_argument("--cfg", default=None, type=int_list(4), help="warps,chunk,stages,min blocks (default: the format's)")
    a = p.parse_args()
    for name in a.fmt.split(","):
        for d in (int(x) for x in a.d.split(",")):
            key = _key(get_format(name).kernel_code, d, torch.bfloat16, a.cfg)
            print(f"{name:9s} D{d} cfg={key[3:]}: {report(Path(a.src), key[0], d, key[3:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
