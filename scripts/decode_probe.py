"""One decode-step's attention kernels at an engine shape, on a GPU: a target for Nsight Compute
and a side-by-side timing of the decode-time store.

    python3 scripts/decode_probe.py --ctx 90000                  # time store (T = 1) + decode per format
    ncu --clock-control none --kernel-name nd_decode --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats ... python3 scripts/decode_probe.py --only rk4v4-e8 --calls 4
    ... --only rk4v4-e8 --calls 4 --geom 24,4,256 --batch 8      # any geometry and batch under ncu
    ... --only rk4v4-e8 --calls 4 --geom 24,4,256 --cfg 8,32,3,1     # any configuration

Store: T new tokens of Hkv heads, bytes checked against the reference encoder, then timed as
CUDA-graph replays (median of do_bench). Decode: ``paged_decode`` over ``ctx`` tokens of random
valid pages (32 q / 8 kv heads, D = 128, the Qwen3-8B geometry), checked against the float64
oracle, timed the same way.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call: `reps` calls captured in one CUDA graph (the kernel bench's timer)."""
    from ninfer.bench.kernels import time_graph
    return time_graph([fn] * reps, 100)


def store_rows(fmts, t: int, hkv: int, d: int) -> list[dict]:
    from ninfer.attention.selector import OpContext, select_ops
    from ninfer.kvcache.formats import get_format
    rows = []
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for name in fmts:
        fmt = get_format(name)
        pages = 64
        planes = {pl.name: torch.zeros((pages, hkv, 64, pl.extent), dtype=pl.dtype, device=dev)
                  for pl in fmt.planes(d, torch.bfloat16)}
        k = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=dev, generator=gen)
        v = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=dev, generator=gen)
        slots = torch.randperm(pages * 64, device=dev, generator=gen)[:t]
        store_kv = select_ops(OpContext(fmt, k.device, k.dtype, k.shape[2], None, k.shape[1], 64))["store"].fn
        store_kv(k, v, planes, slots)
        torch.cuda.synchronize()
        bad = 0
        for which, x in (("k", k), ("v", v)):
            data, sc = fmt.encode(x.cpu())
            got = planes[which][slots // 64, :, slots % 64].cpu()
            bad += int((got.view(torch.uint8) != data.to(got.dtype).view(torch.uint8)).sum())
            if sc is not None:
                gs = planes[f"{which}_scale"][slots // 64, :, slots % 64].cpu()
                bad += int((gs != sc).sum())
        us = graph_us(lambda: store_kv(k, v, planes, slots))
        rows.append({"kind": "store", "format": name, "tokens": t, "hkv": hkv, "d": d, "mismatches": bad, "us": us})
    return rows


def decode_rows(fmts, ctx: int, calls: int | None, geom=(32, 8, 128), variants=(None,), batch: int = 1,
                cfg0=None) -> list[dict]:
    from ninfer.bench.kernels import DecodeCase
    from ninfer.kernels.paged_decode import cuda_kernel_info, default_cfg, paged_decode_cuda, paged_decode_ref
    from ninfer.kvcache.formats import get_format
    rows = []
    hq, hkv, d = geom
    for name in fmts:
        c = DecodeCase(name, hq, hkv, d, ctx, batch, 1)
        ref = None
        for var in variants:
            cfg = cfg0 if var is None else (*default_cfg(get_format(name).kernel_code, d)[:3], var)
            if cfg is not None and name == "int8":
                continue  # the control runs its default only

            def call():
                return paged_decode_cuda(c.q, c.kp, c.vp, c.tables[0], c.seq_lens, c.fmt, c.scale, out=c.outs[0],
                                         cuda_cfg=cfg)
            if calls:  # under ncu: plain launches only
                for _ in range(calls):
                    call()
                torch.cuda.synchronize()
                continue
            c.outs[0].fill_(float("nan"))
            call()
            if ref is None:
                ref = paged_decode_ref(c.q, c.kp, c.vp, c.tables[0], c.seq_lens, c.fmt, c.scale)
            rel = float((c.outs[0].float() - ref).norm() / ref.norm())
            info = cuda_kernel_info(c.fmt, d, torch.device("cuda"), cfg=cfg)
            rows.append({"kind": "decode", "format": name, "ctx": ctx, "geometry": f"{hq}q/{hkv}kv/D{d}",
                         "variant": var, "regs": info["regs"], "blocks_per_sm": info["blocks_per_sm"],
                         "rel_err": rel, "us": graph_us(call, 10)})
        c = ref = None  # free the pool before the next format
    return rows


def prebuild(fmts, dims, variants, programs=None) -> None:
    """nvcc every configuration of every program (default: the engine's) at once: each build takes
    seconds, the machine has cores."""
    from concurrent.futures import ThreadPoolExecutor
    from ninfer.kernels.paged_decode_cuda import _CUDA, _key, default_cfg
    from ninfer.kvcache.formats import get_format
    programs = list(programs or [_CUDA])
    major, minor = torch.cuda.get_device_capability()
    keys = set()  # D256 ignores the register cap: one key for both variants
    for name in fmts:
        code = get_format(name).kernel_code
        for d in dims:
            for var in variants:
                cfg = default_cfg(code, d) if var is None else (*default_cfg(code, d)[:3], var)
                keys.add(_key(code, d, torch.bfloat16, cfg))
    jobs = [(prog, key) for prog in programs for key in sorted(keys)]
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda j: j[0].build(j[1], f"sm_{major}{minor}"), jobs))


def int_list(n: int):
    """argparse type: exactly n comma-separated integers."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in text.split(","))
        except ValueError:
            vals = ()
        if len(vals) != n:
            raise argparse.ArgumentTypeError(f"expected {n} comma-separated integers, got {text!r}")
        return vals
    return parse


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=90000)
    p.add_argument("--only", default=None, help="one format (decode only), e.g. under ncu")
    p.add_argument("--calls", type=int, default=None, help="with --only: launch this many decodes, no timing")
    p.add_argument("--geom", default=(32, 8, 128), type=int_list(3), help="with --only: q heads, kv heads, head dim")
    p.add_argument("--batch", type=int, default=1, help="with --only: sequences")
    p.add_argument("--cfg", default=None, type=int_list(4),
                   help="with --only: warps,chunk,stages,min blocks (default: the format's)")
    p.add_argument("--variants", action="store_true",
                   help="also time the 4-bit kernels compiled without the register cap (MINB 1)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.only:
        decode_rows([a.only], a.ctx, a.calls, a.geom, batch=a.batch, cfg0=a.cfg)
        return 0
    rows = []
    for t in (1, 8, 4096):
        rows += store_rows(("bf16", "int8", "rk4v4-e8"), t, 8, 128)
    var = (None, 1) if a.variants else (None,)
    fmts = ("int8", "rk4v4", "rk4v4-e8")
    prebuild(fmts, (128, 256), var)
    for geom in ((32, 8, 128), (24, 4, 256)):
        for ctx in (a.ctx, 131072):
            rows += decode_rows(fmts, ctx, None, geom, var if geom[2] == 128 else (None,))
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    for r in rows:
        extra = f"mismatches={r['mismatches']}" if r["kind"] == "store" else f"rel_err={r['rel_err']:.2e}"
        size = (f"T={r['tokens']}" if r["kind"] == "store" else
                f"ctx={r['ctx']} {r['geometry']} minb={r['variant'] or 'dflt'} regs={r['regs']} bps={r['blocks_per_sm']}")
        print(f"{r['kind']:7s} {r['format']:9s} {size:28s} {r['us']:9.2f} us  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
