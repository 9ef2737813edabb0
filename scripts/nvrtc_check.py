"""The CUDA decode kernel built by NVRTC (as on a machine without nvcc) against the nvcc build, side
by side on one GPU: registers and occupancy of the NVRTC build, then per format and geometry at
128K, batch 1, both checked against the float64 oracle and timed as CUDA-graph replays in ABBA rounds.

    PYTHONPATH=$PWD NINFER_CACHE_DIR=/tmp/rtc_cache python3 scripts/nvrtc_check.py
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.bench.kernels import DecodeCase, time_graph  # noqa: E402
from ninfer.kernels import cuda_build as cb  # noqa: E402
from ninfer.kernels import nvrtc  # noqa: E402
from ninfer.kernels import paged_decode as pd  # noqa: E402
from ninfer.kernels import paged_decode_cuda as pdc  # noqa: E402
from ninfer.kvcache.formats import get_format  # noqa: E402

GEOMS = ((32, 8, 128), (24, 4, 256))
FMTS = ("int8", "rk4v4", "rk4v4-e8")


def use(prog) -> None:
    pdc._CUDA = pd._CUDA = prog


def main() -> int:
    real = cb.nvcc_path
    print("nvcc:", real(), "| nvrtc:", nvrtc.unavailable() or "%d.%d" % nvrtc.version(), "| lib:", nvrtc._lib()[0]._name)
    dev = torch.device("cuda")
    rtc = pdc._CudaDecode()
    cb.nvcc_path = lambda: None  # every module of `rtc` is built (and loaded) while nvcc is hidden
    try:
        for f in FMTS:
            for _hq, _hkv, d in GEOMS:
                info = rtc.function(pdc._key(get_format(f).kernel_code, d, torch.bfloat16), dev)
                print("nvrtc", f, d, "regs", info[4], "blocks/SM", info[3])
    finally:
        cb.nvcc_path = real
    progs = {"nvcc": pdc._CUDA, "nvrtc": rtc}
    for f in FMTS:
        for hq, hkv, d in GEOMS:
            c = DecodeCase(f, hq, hkv, d, 131072, 1, 1)

            def call():
                return pd.paged_decode_cuda(c.q, c.kp, c.vp, c.tables[0], c.seq_lens, c.fmt, c.scale, out=c.outs[0])
            ref = pd.paged_decode_ref(c.q, c.kp, c.vp, c.tables[0], c.seq_lens, c.fmt, c.scale)
            err, us = {}, {k: [] for k in progs}
            for name, prog in progs.items():
                use(prog)
                c.outs[0].fill_(float("nan"))
                call()
                err[name] = float((c.outs[0].double() - ref).norm() / ref.norm())
            for r in range(4):
                for name in (("nvcc", "nvrtc") if r % 2 == 0 else ("nvrtc", "nvcc")):
                    use(progs[name])
                    us[name].append(time_graph([call] * 10, 60))
            use(progs["nvcc"])
            m = {k: statistics.median(v) for k, v in us.items()}
            ratio = statistics.median(b / a for a, b in zip(us["nvcc"], us["nvrtc"]))
            print(f"{f:9s} D{d} 128K B1: nvcc {m['nvcc']:.2f} us  nvrtc {m['nvrtc']:.2f} us  nvrtc/nvcc {ratio:.3f}  "
                  f"rel_err {err['nvcc']:.2e} / {err['nvrtc']:.2e}", flush=True)
            c = ref = None
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
