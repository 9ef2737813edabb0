"""Where a batch-1 decode call's time goes, on a GPU: the CUDA split kernel alone, the split merge
(``decode_reduce``) alone, both (what ``paged_decode`` launches), and one tiny kernel (a graph
node's floor), each timed like ``ninfer bench kernels`` (CUDA-graph replays over page sets >= 4x
the L2, read flush before each replay, median), per format, geometry and context.

    PYTHONPATH=$PWD python3 scripts/decode_fixed_cost.py --out $OUT/decode_fixed_cost.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.bench import kernels as kb  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default="int8,rk4v4,rk4v4-e8")
    p.add_argument("--ctx", default="8192,32768,131072")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from ninfer.kernels.decode_reduce import decode_reduce
    from ninfer.kernels.paged_decode import paged_decode_cuda
    from ninfer.kernels.paged_decode_cuda import _paged_decode_cuda_split, cuda_num_splits, default_cfg
    from ninfer.kvcache.formats import get_format

    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    tiny = torch.zeros(1, device="cuda")
    noop = kb.time_graph([lambda: tiny.add_(1)] * 8, a.rep_ms)
    print(f"one tiny kernel per graph node: {noop:.2f} us", flush=True)
    rows = []
    for geo, (hq, hkv, d) in kb.GEOMETRIES.items():
        for ctx in [int(x) for x in a.ctx.split(",")]:
            for fmt_name in a.formats.split(","):
                fmt = get_format(fmt_name)
                case = kb.DecodeCase(fmt_name, hq, hkv, d, ctx, a.batch, l2_bytes=l2)
                code = fmt.kernel_code
                cfg = default_cfg(code, d)
                splits = cuda_num_splits(a.batch, hkv, case.tables[0].shape[1], case.q.device, fmt, d,
                                         case.q.dtype, cfg)
                mids = [(torch.empty(a.batch * hq, splits, d, device="cuda"),
                         torch.empty(a.batch * hq, splits, device="cuda")) for _ in range(case.sets)]
                kp, vp = case.kp, case.vp

                def split(i):
                    _paged_decode_cuda_split(case.q, kp[0], kp[1], vp[0], vp[1], case.tables[i], case.seq_lens,
                                             mids[i][0], mids[i][1], code, case.scale, splits, cfg)

                def reduce(i):
                    decode_reduce(mids[i][0], mids[i][1], case.outs[i].view(-1, d), rotated=False)

                def full(i):
                    paged_decode_cuda(case.q, kp, vp, case.tables[i], case.seq_lens, fmt, case.scale,
                                      out=case.outs[i])

                r = {"geo": geo, "ctx": ctx, "batch": a.batch, "format": fmt_name, "splits": splits,
                     "sets": case.sets}
                for name, fn in (("full", full), ("split", split), ("reduce", reduce)):
                    r[name] = kb.time_graph([lambda i=i: fn(i) for i in range(case.sets)], a.rep_ms)
                rows.append(r)
                print(r, flush=True)
                case = mids = None
                torch.cuda.empty_cache()
    print("\n| geometry | ctx | format | splits | full us | split us | reduce us | split + reduce |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['geo']} | {r['ctx'] // 1024}K | {r['format']} | {r['splits']} | {r['full']:.1f} | "
              f"{r['split']:.1f} | {r['reduce']:.1f} | {r['split'] + r['reduce']:.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "noop_us": noop,
                                           "command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
