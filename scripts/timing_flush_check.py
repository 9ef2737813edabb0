"""Does the kernel bench's L2 flush change what it measures? The same CUDA graphs timed three ways:

* ``zero``: ``triton.testing.do_bench`` as ``ninfer bench kernels`` uses it: a 256 MB ``zero_()``
  before every timed replay. It leaves the L2 full of dirty lines, which the timed kernel then
  writes back to HBM while it reads.
* ``read``: the same loop, the flush a read of a 256 MB buffer (the L2 left holding clean lines).
* ``none``: back-to-back replays, no flush (the page sets themselves are >= 4x the L2).

Cases: decode at 128K (batch 1 and 8), both geometries, int8 / rk4v4 / rk4v4-e8 on the CUDA path
and torch SDPA bf16 (flash, cuDNN); the 16384-token store.

    PYTHONPATH=$PWD python3 scripts/timing_flush_check.py --out $OUT/flush_check.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.bench import kernels as kb  # noqa: E402


def measure(g, n_calls, cache, rep_ms, rounds):
    """Median us per call for each flush, over rounds; each rep = flush (untimed) + one replay."""
    flushes = {"zero": lambda: cache.zero_(), "read": lambda: cache.view(torch.int32).sum(),
               "none": lambda: None}
    out = {m: [] for m in flushes}
    for _ in range(rounds):
        for m, fl in flushes.items():
            out[m].append(kb.median_us(g.replay, rep_ms, flush=fl) / n_calls)
    return {m: statistics.median(v) for m, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ctx", type=int, default=131072)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    from ninfer.kernels.paged_decode import paged_decode_cuda
    from ninfer.kvcache.formats import get_format
    rows = []
    for geo in ("24q4kv-d256", "32q8kv-d128"):
        hq, hkv, d = kb.GEOMETRIES[geo]
        for bsz in [int(x) for x in a.batch.split(",")]:
            for fmt in ("int8", "rk4v4", "rk4v4-e8"):
                case = kb.DecodeCase(fmt, hq, hkv, d, a.ctx, bsz, l2_bytes=l2)
                calls = [lambda i=i: paged_decode_cuda(case.q, case.kp, case.vp, case.tables[i], case.seq_lens,
                                                       case.fmt, case.scale, out=case.outs[i])
                         for i in range(case.sets)]
                g = kb.capture_graph(calls)
                r = {"kind": "decode", "format": fmt, "geo": geo, "batch": bsz, "sets": case.sets,
                     **measure(g, case.sets, cache, a.rep_ms, a.rounds)}
                rows.append(r)
                print(r, flush=True)
                del g
                torch.cuda.empty_cache()
            for be in ("flash", "cudnn"):
                from torch.nn.attention import SDPBackend, sdpa_kernel
                sdb = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[be]
                per_set = 2 * bsz * a.ctx * hkv * d * 2
                sets = kb.sets_for(per_set, l2)
                qs = torch.randn(bsz, hq, 1, d, dtype=torch.bfloat16, device="cuda")
                kv = [(torch.randn(bsz, hkv, a.ctx, d, dtype=torch.bfloat16, device="cuda"),
                       torch.randn(bsz, hkv, a.ctx, d, dtype=torch.bfloat16, device="cuda")) for _ in range(sets)]

                def sd(i):
                    with sdpa_kernel([sdb]):
                        return torch.nn.functional.scaled_dot_product_attention(qs, kv[i][0], kv[i][1],
                                                                                enable_gqa=True)
                try:
                    g = kb.capture_graph([lambda i=i: sd(i) for i in range(sets)])
                    r = {"kind": "sdpa", "format": be, "geo": geo, "batch": bsz, "sets": sets,
                         **measure(g, sets, cache, a.rep_ms, a.rounds)}
                    del g
                except Exception as e:  # noqa: BLE001 - report and go on
                    r = {"kind": "sdpa", "format": be, "geo": geo, "batch": bsz, "error": str(e)[:200]}
                rows.append(r)
                print(r, flush=True)
                kv = None
                torch.cuda.empty_cache()
    from ninfer.attention.selector import OpContext, select_ops
    for fmt in ("int8", "rk4v4", "rk4v4-e8"):
        tokens, hkv, d, sets = 16384, 8, 128, 8
        num_pages = tokens // kb.PAGE * 8
        planes = {pl.name: torch.zeros(num_pages, hkv, kb.PAGE, pl.extent, dtype=pl.dtype, device="cuda")
                  for pl in get_format(fmt).planes(d, torch.bfloat16)}
        ks = [torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
        vs = [torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
        slots = [kb.store_slots(tokens, num_pages, "pages") for _ in range(sets)]
        store_kv = select_ops(OpContext(get_format(fmt), torch.device("cuda"), torch.bfloat16, d, None, hkv,
                                        kb.PAGE))["store"].fn
        for n_sets in (8, 1):
            g = kb.capture_graph([lambda i=i: store_kv(ks[i], vs[i], planes, slots[i]) for i in range(n_sets)])
            r = {"kind": "store", "format": fmt, "geo": "8kv/D128", "tokens": tokens, "sets": n_sets,
                 **measure(g, n_sets, cache, a.rep_ms, a.rounds)}
            rows.append(r)
            print(r, flush=True)
            del g
        planes = ks = vs = None
        torch.cuda.empty_cache()
    print("\n| kind | format | geometry | batch | sets | zero-flush us | read-flush us | no flush us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "zero" in r:
            print(f"| {r['kind']} | {r['format']} | {r['geo']} | {r.get('batch', '')} | {r['sets']} | "
                  f"{r['zero']:.1f} | {r['read']:.1f} | {r['none']:.1f} |")
    for geo in ("24q4kv-d256", "32q8kv-d128"):
        for bsz in [int(x) for x in a.batch.split(",")]:
            sel = {r["format"]: r for r in rows if r["kind"] == "decode" and r["geo"] == geo and r["batch"] == bsz}
            if "int8" in sel and "rk4v4-e8" in sel:
                print(f"e8/int8 {geo} B{bsz}: " + ", ".join(
                    f"{m} {sel['rk4v4-e8'][m] / sel['int8'][m]:.3f}" for m in ("zero", "read", "none")))
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": props.name, "command": " ".join(sys.argv), "rows": rows},
                                          indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
