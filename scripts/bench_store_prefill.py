"""GPU check + timing of the store and chunked-prefill kernels (docs/KERNELS.md "Store and prefill").

Run from the repository root on a CUDA machine (finishes in well under 90 s on an H200):

    PYTHONPATH=$PWD python3 scripts/bench_store_prefill.py --out $OUT/store_prefill.json

Store: 16384 new tokens of random bf16 K/V per format, geometries 4kv/D256 and 8kv/D128, scattered
to random slots of a pool; checked against the reference encoder (``fmt.encode`` + scatter) on the
GPU: scales and codes compared byte for byte (random bf16 inputs are not exact in float32, so the
kernel's butterfly and torch's matmul may round a rotated value differently in the last ulp and
rarely flip a code: ``bad`` is the fraction of differing data bytes, ok when <= 1e-3). Rotated
formats (D256 geometry) are also timed with the previous rotation (fp32 FMA ``tl.dot``, ``STORE_FWHT=False``).
% copy = (bf16 K/V read + planes written + slots) / measured device-to-device copy bandwidth.

Prefill: one sequence, 128K cached tokens + a 1024-token chunk, geometries 24q/4kv/D256 and
32q/8kv/D128, every format; random pages (codes/scales). Checked on the last 32 query tokens
against ``paged_prefill_ref`` (kv_round=fp16 for the scaled formats; rel. Frobenius error, ok when
<= 1e-2). Then a small tiling sweep (block_m, block_n, num_warps) per quantized case while time is
left, the best reported next to the default. Timing: median of ``triton.testing.do_bench``; stores
as CUDA-graph replays over distinct inputs (``graph_store_us``).
Every case runs in try/except: an error is a row with ``error``, never fatal.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMATS = ("bf16", "int8", "rk4v4", "rk4v4-e8")
GEOMS = ((24, 4, 256), (32, 8, 128))  # (hq, hkv, d)
PAGE = 64
DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: logic dry run only
SWEEP = {256: [(32, 32, 4), (64, 32, 4), (64, 32, 8), (64, 64, 8), (128, 32, 8), (32, 64, 4)],
         128: [(64, 32, 4), (64, 64, 4), (128, 64, 8), (128, 32, 4), (64, 32, 8)]}


def bench(fn, rep=40):
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3  # us


def copy_bw() -> float:
    import torch
    x = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    us = bench(lambda: y.copy_(x))
    return 2 * x.numel() / (us * 1e-6)  # bytes/s, read + write


def store_inputs(fmt_name, hkv, d, tokens, gen, pattern="pages"):
    """Random bf16 K/V of `tokens` rows, distinct slots in a pool twice that size (``store_slots``:
    whole pages in random order as a prefill writes them, or every token scattered), and a maker
    of zeroed planes for it."""
    import torch

    from ninfer.kvcache.formats import get_format
    fmt = get_format(fmt_name)
    dev = torch.device(DEV)
    pages = max(2, 2 * tokens // PAGE)
    k = torch.randn(tokens, hkv, d, device=dev, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, hkv, d, device=dev, generator=gen).to(torch.bfloat16) * 3
    from ninfer.bench.kernels import store_slots
    slots = store_slots(tokens, pages, pattern, dev, gen)

    def new_planes():
        return {pl.name: torch.zeros(pages, hkv, PAGE, pl.extent, dtype=pl.dtype, device=dev)
                for pl in fmt.planes(d, torch.bfloat16)}
    return fmt, k, v, slots, new_planes


def graph_store_us(k, v, slots, planes, store, gen, sets=4):
    """Microseconds per store: `sets` stores of distinct random K/V (the first is k, v) and
    distinct slot orders, captured in one CUDA graph and replayed (``time_graph``). A 10-100 us
    kernel timed by eager calls measures the host's launch path as well; inputs are never reused
    from L2."""
    import torch

    from ninfer.bench.kernels import time_graph
    ks = [k] + [torch.randn(k.shape, device=k.device, generator=gen).to(k.dtype) for _ in range(sets - 1)]
    vs = [v] + [torch.randn(v.shape, device=v.device, generator=gen).to(v.dtype) * 3 for _ in range(sets - 1)]
    ss = [slots] + [slots[torch.randperm(slots.numel(), device=slots.device, generator=gen)] for _ in range(sets - 1)]
    return time_graph([lambda i=i: store(ks[i], vs[i], planes, ss[i]) for i in range(sets)], 60)


def store_op(fmt, hkv, d, backend):
    """store(k, v, planes, slots): "cuda" / "triton" by name, "auto" = what the engine's selector picks."""
    import torch

    from ninfer.attention.selector import OpContext, select_ops
    from ninfer.kernels.store_kv import store_kv_triton
    from ninfer.kernels.store_kv_cuda import store_kv_cuda
    if backend == "auto":
        return select_ops(OpContext(fmt, torch.device(DEV), torch.bfloat16, d, None, hkv, PAGE))["store"].fn
    kernel = {"cuda": store_kv_cuda, "triton": store_kv_triton}[backend]
    return lambda k, v, planes, slots: kernel(k, v, planes, slots, fmt)


def store_case(fmt_name, hkv, d, tokens, bw, gen, compare_dot=True, backend="auto", pattern="pages"):
    import torch

    import ninfer.kernels.store_kv as sk

    row = {"kind": "store", "format": fmt_name, "hkv": hkv, "d": d, "tokens": tokens, "backend": backend,
           "slots": pattern}
    fmt, k, v, slots, new_planes = store_inputs(fmt_name, hkv, d, tokens, gen, pattern)
    planes = new_planes()
    store = store_op(fmt, hkv, d, backend)
    store(k, v, planes, slots)
    torch.cuda.synchronize()
    pg, off = slots // PAGE, slots % PAGE
    bad, nbytes, sbad = 0, 0, 0
    for which, x in (("k", k), ("v", v)):
        data, sc = fmt.encode(x)
        ref = data.to(planes[which].dtype)
        got = planes[which][pg, :, off]
        bad += int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
        nbytes += got.numel() * got.element_size()
        if sc is not None:
            sbad += int((planes[f"{which}_scale"][pg, :, off] != sc).sum())
    row.update(bad=bad / nbytes, scale_mismatch=sbad, ok=bad / nbytes <= 1e-3 and sbad <= 2)
    moved = 2 * k.numel() * 2 + slots.numel() * 8 + sum(
        p.element_size() * tokens * hkv * p.shape[3] for p in planes.values())
    us = graph_store_us(k, v, slots, planes, store, gen)
    row.update(us=us, pct_copy=100 * moved / (us * 1e-6) / bw)
    if fmt.rotated and compare_dot and backend == "triton":
        old = sk.STORE_FWHT
        try:
            sk.STORE_FWHT = False
            row["us_dot_rotation"] = graph_store_us(
                k, v, slots, planes, store, gen)
        finally:
            sk.STORE_FWHT = old
    return row


def store_latency(fmt_name, hkv, d, tokens, gen, backend):
    """A decode step's store (T = 1 or a few tokens), timed as CUDA-graph replays of 64 calls on
    distinct inputs (the engine replays it inside its decode graph; eager timing would measure
    the host's launch cost)."""
    from ninfer.bench.kernels import time_graph

    sets = 64
    fmt, k, v, slots, new_planes = store_inputs(fmt_name, hkv, d, tokens * sets, gen, "scattered")
    planes = new_planes()
    store = store_op(fmt, hkv, d, backend)
    calls = [lambda i=i: store(k[i * tokens:(i + 1) * tokens], v[i * tokens:(i + 1) * tokens], planes,
                               slots[i * tokens:(i + 1) * tokens]) for i in range(sets)]
    return {"kind": "store_latency", "format": fmt_name, "hkv": hkv, "d": d, "tokens": tokens, "backend": backend,
            "us": time_graph(calls, 60)}


def prefill_case(fmt_name, hq, hkv, d, ctx, chunk, gen, sweep_until):
    import torch

    from ninfer.bench.kernels import random_planes
    from ninfer.kernels.prefill import _default_tiles, paged_prefill_ref, paged_prefill_triton
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    dev = torch.device(DEV)
    seq = ctx + chunk
    npages = -(-seq // PAGE)
    planes = random_planes(fmt, d, hkv, npages, dev, gen)
    kp, vp = (planes["k"], planes.get("k_scale")), (planes["v"], planes.get("v_scale"))
    table = torch.randperm(npages, device=dev, generator=gen).to(torch.int32)[None, :].contiguous()
    q = torch.randn(chunk, hq, d, device=dev, generator=gen).to(torch.bfloat16)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    lens = torch.tensor([seq], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    scale = d ** -0.5
    row = {"kind": "prefill", "format": fmt_name, "hq": hq, "hkv": hkv, "d": d, "context": ctx, "chunk": chunk,
           "default_tiles": list(_default_tiles(fmt.kernel_code, d))}

    def run(**kw):
        return paged_prefill_triton(q, kp, vp, qsl, lens, table, chunk, fmt, scale, out=out, **kw)

    run()
    torch.cuda.synchronize()
    n = 32  # check the last n query tokens (the ones that see every key)
    qs = torch.tensor([0, n], dtype=torch.int32, device=dev)
    ref = paged_prefill_ref(q[-n:], kp, vp, qs, lens, table, n, fmt, scale,
                            kv_round=torch.float16 if fmt.has_scales else None).float()
    got = out[-n:].float()
    rel = float((got - ref).norm() / ref.norm())
    row.update(rel=rel, finite=bool(torch.isfinite(out).all()), ok=rel <= 1e-2 and bool(torch.isfinite(out).all()))
    row["ms"] = bench(run) / 1e3
    flops = 4 * hq * d * (ctx * chunk + chunk * chunk / 2)
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    sweep = []
    if fmt.has_scales or fmt_name == "bf16":
        for bm, bn, nw in [c for c in SWEEP[d] if list(c) != row["default_tiles"]]:
            if time.time() > sweep_until:
                sweep.append({"tiles": [bm, bn, nw], "skipped": "time"})
                continue
            try:
                run(block_m=bm, block_n=bn, num_warps=nw)
                torch.cuda.synchronize()
                r2 = float((out[-n:].float() - ref).norm() / ref.norm())
                sweep.append({"tiles": [bm, bn, nw], "ms": bench(lambda: run(block_m=bm, block_n=bn, num_warps=nw),
                                                                 rep=20) / 1e3, "rel": r2})
            except Exception as e:  # noqa: BLE001
                sweep.append({"tiles": [bm, bn, nw], "error": f"{type(e).__name__}: {str(e)[:160]}"})
    good = [s for s in sweep if "ms" in s and s["rel"] <= 1e-2]
    if good:
        best = min(good, key=lambda s: s["ms"])
        row.update(best_tiles=best["tiles"], best_ms=best["ms"])
    row["sweep"] = sweep
    del planes, kp, vp
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "store_prefill.json"))
    ap.add_argument("--context", type=int, default=128 * 1024)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--no-sweep", action="store_true", help="only the default prefill tiling")
    ap.add_argument("--budget-s", type=float, default=65.0, help="stop tiling sweeps after this much time")
    ap.add_argument("--store-only", action="store_true",
                    help="store only (8kv/D128): both backends, and decode-sized stores (T = 1, 8)")
    args = ap.parse_args()
    import torch
    t0 = time.time()
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    bw = copy_bw()
    geoms = () if args.store_only else GEOMS
    if args.store_only:
        for f in ("rk4v4-e8", "rk4v4", "int8", "bf16"):
            new = []
            for be in (("cuda", "triton") if f.startswith("rk4") else ("triton",)):
                for pat in ("pages", "scattered"):
                    new.append(store_case(f, 8, 128, args.tokens, bw, gen, compare_dot=False, backend=be, pattern=pat))
                new += [store_latency(f, 8, 128, t, gen, be) for t in (1, 8)]
            for r in new:
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            rows += new
    for hq, hkv, d in geoms:
        for f in FORMATS:
            try:
                rows.append(store_case(f, hkv, d, args.tokens, bw, gen, compare_dot=d == 256))  # compiles cost time
            except Exception as e:  # noqa: BLE001
                rows.append({"kind": "store", "format": f, "hkv": hkv, "d": d, "ok": False,
                             "error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-800:]})
            torch.cuda.empty_cache()
    n_pref = len(GEOMS) * len(FORMATS)
    for i, (hq, hkv, d) in enumerate(geoms):
        for j, f in enumerate(FORMATS):
            # leave each remaining case its share of the budget for its sweep
            left = args.budget_s - (time.time() - t0)
            until = 0.0 if args.no_sweep else time.time() + max(0.0, left / (n_pref - (i * len(FORMATS) + j)) - 4.0)
            try:
                rows.append(prefill_case(f, hq, hkv, d, args.context, args.chunk, gen, until))
            except Exception as e:  # noqa: BLE001
                rows.append({"kind": "prefill", "format": f, "hq": hq, "hkv": hkv, "d": d, "ok": False,
                             "error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-800:]})
            torch.cuda.empty_cache()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {torch.cuda.get_device_name(0)}; {time.time() - t0:.0f} s")
    print("| kernel | geometry | format | time | % copy / TFLOP/s | check | alt |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        geo = f"{r.get('hkv')}kv/D{r.get('d')}" if r["kind"] == "store" else f"{r.get('hq')}q/{r.get('hkv')}kv/D{r.get('d')}"
        if "error" in r:
            print(f"| {r['kind']} | {geo} | {r['format']} | ERROR | | {r['error'][:120]} | |")
        elif r["kind"] == "store_latency":
            print(f"| store T={r['tokens']} (graph) | {geo} | {r['format']} {r['backend']} | {r['us']:.2f} us | | | |")
        elif r["kind"] == "store":
            alt = f"dot-rotation {r['us_dot_rotation']:.1f} us" if "us_dot_rotation" in r else ""
            print(f"| store ({r['slots']}) | {geo} | {r['format']} {r['backend']} | {r['us']:.1f} us | {r['pct_copy']:.1f}% | "
                  f"{'ok' if r['ok'] else 'FAIL'} bad={r['bad']:.1e} sc={r['scale_mismatch']} | {alt} |")
        else:
            alt = f"sweep best {r['best_tiles']}: {r['best_ms']:.2f} ms" if "best_ms" in r else ""
            print(f"| prefill | {geo} | {r['format']} | {r['ms']:.2f} ms {r['default_tiles']} | {r['tflops']:.0f} | "
                  f"{'ok' if r['ok'] else 'FAIL'} rel={r['rel']:.1e} | {alt} |")
    res = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "copy_bw_gbs": bw / 1e9, "wall_s": time.time() - t0, "rows": rows}
    try:
        import triton
        res["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
