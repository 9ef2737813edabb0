"""Attention/store kernel timings vs copy bandwidth (GPU): paged decode per KV format, side by side
with torch SDPA bf16 (flash and cuDNN backends) and the int8 control, in one run.

For each geometry (24q/4kv/D256 and 32q/8kv/D128) x context x batch and each format/backend:
* correctness first, at the real shape: ``paged_decode_{triton,cuda}`` vs ``paged_decode_ref`` (planes decoded by
  the format registry, float64 attention on the GPU), relative error bound 1e-2 (2e-2 for bf16);
  a kernel that fails is reported and not timed;
* time: median over replays of a CUDA graph of decode calls over R disjoint page sets (R chosen so
  the sets together are at least 4x the L2 size: no call is served from L2), cycled to at least
  MIN_CALLS calls for every format, divided by the calls; before each timed replay the L2 is flushed
  by *reading* 256 MB (``median_us``);
* bytes moved: K/V bytes actually read (data + scales of every cached token) + q + out; percent of
  the device-to-device copy bandwidth measured in the same run (bytes read + written);
* ratios to the int8 control (the faster of its backends) and to SDPA bf16 (flash, cuDNN) on a
  contiguous bf16 K/V of the same length (``enable_gqa=True``, no K/V expansion).
Store (the store op the engine selects, ``ninfer.attention.selector``) and prefill
(``ninfer.kernels.prefill``) rows are added when those modules exist; otherwise the report says they are absent.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import time

from ninfer.bench.kernel_report import _fmt, add_ratios, table  # noqa: F401  (re-exported)
from ninfer.bench.kernel_timing import (MIN_CALLS, capture_graph, copy_bandwidth,  # noqa: F401
                                        median_us, replay_sets, time_graph)

GEOMETRIES = {"24q4kv-d256": (24, 4, 256), "32q8kv-d128": (32, 8, 128)}
FORMATS = ("bf16", "int8", "rk4v4", "rk4v4-e8")
PAGE = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the full JSON result to stdout")
    p.add_argument("--out", default=None, help="write the JSON result to this file")
    p.add_argument("--contexts", default="32k,128k", help="comma list, e.g. 32k,128k,512k")
    p.add_argument("--batch", default="1", help="comma list of batch sizes, e.g. 1,8")
    p.add_argument("--quick", action="store_true", help="fewer repeats, only 128k x batch 1 unless given")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--backends", default="triton,cuda", help="decode backends to time (triton, cuda)")
    p.add_argument("--geometries", default=",".join(GEOMETRIES))
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--no-store", action="store_true")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--rep-ms", type=int, default=200, help="ms of timed replays per measurement")


def _tokens(s: str) -> int:
    s = s.strip().lower()
    if s.endswith("k"):
        return int(float(s[:-1]) * 1024)
    if s.endswith("m"):
        return int(float(s[:-1]) * 1024 * 1024)
    return int(s)


# ----------------------------------------------------------------------------- data

def random_planes(fmt, d: int, hkv: int, num_pages: int, dev, gen) -> dict:
    """Random pool planes of a format (valid codes, realistic fp16 scales): timing data, never zeros."""
    import torch

    planes = {}
    for pl in fmt.planes(d, torch.bfloat16):
        shape = (num_pages, hkv, PAGE, pl.extent)
        if pl.name.endswith("_scale"):
            t = torch.empty(shape, dtype=torch.float16, device=dev).uniform_(0.02, 0.12, generator=gen)
        elif pl.dtype == torch.uint8:
            t = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)
        elif pl.dtype == torch.int8:
            t = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev, generator=gen)
        else:
            t = torch.randn(shape, dtype=pl.dtype, device=dev, generator=gen)
        planes[pl.name] = t
    return planes

class DecodeCase:
    """R disjoint page sets of B sequences of length L (random page order) in one pool per format.
    ``sets`` <= 0: as many as cover 4x the L2 (``sets_for``; ``l2_bytes`` defaults to the device's), so
    replays that rotate over the sets read every call's pages from HBM."""

    def __init__(self, fmt_name: str, hq: int, hkv: int, d: int, ctx: int, batch: int, sets: int = 0,
                 seed: int = 0, device: str = "cuda", l2_bytes: int | None = None):
        import torch

        from ninfer.kvcache.formats import get_format

        self.fmt = get_format(fmt_name)
        self.hq, self.hkv, self.d, self.ctx, self.batch = hq, hkv, d, ctx, batch
        dev = torch.device(device)
        if sets <= 0:
            l2 = l2_bytes or torch.cuda.get_device_properties(dev).L2_cache_size
            sets = sets_for(self.kv_bytes(), l2)
        self.sets = sets
        gen = torch.Generator(device=dev).manual_seed(seed)
        pages_per_seq = math.ceil(ctx / PAGE)
        num_pages = pages_per_seq * batch * sets
        self.planes = random_planes(self.fmt, d, hkv, num_pages, dev, gen)
        perm = torch.randperm(num_pages, device=dev, generator=gen).to(torch.int32)
        self.tables = [perm[i * batch * pages_per_seq:(i + 1) * batch * pages_per_seq].view(batch, pages_per_seq)
                       .contiguous() for i in range(sets)]
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device=dev, generator=gen)
        self.outs = [torch.empty_like(self.q) for _ in range(sets)]
        self.scale = d ** -0.5

    @property
    def kp(self):
        return (self.planes["k"], self.planes.get("k_scale"))

    @property
    def vp(self):
        return (self.planes["v"], self.planes.get("v_scale"))

    def kv_bytes(self) -> int:
        return self.batch * self.ctx * self.hkv * self.fmt.bytes_per_token_head(self.d, __import__("torch").bfloat16)

    def io_bytes(self) -> int:
        return 2 * self.q.numel() * self.q.element_size()


def sets_for(bytes_per_set: int, l2_bytes: int, cap_bytes: int = 24 << 30) -> int:
    need = max(1, math.ceil(4 * l2_bytes / max(1, bytes_per_set)))
    return int(max(1, min(need, 16, max(1, cap_bytes // max(1, bytes_per_set)))))


# ----------------------------------------------------------------------------- benches
def bench_decode_format(fmt_name: str, backend: str, hq: int, hkv: int, d: int, ctx: int, batch: int,
                        l2: int, rep_ms: int, copy_bw: float, extra: dict | None = None,
                        case: "DecodeCase | None" = None) -> tuple[dict, "DecodeCase"]:
    import torch

    from ninfer.kernels.paged_decode import paged_decode_cuda, paged_decode_ref, paged_decode_triton

    decode = {"triton": paged_decode_triton, "cuda": paged_decode_cuda}.get(backend)
    if decode is None:
        raise ValueError(f"decode backend must be triton or cuda, got {backend!r}")
    extra = dict(extra or {})
    label = extra.pop("label", None)
    if case is None:
        case = DecodeCase(fmt_name, hq, hkv, d, ctx, batch, l2_bytes=l2)
    row = {"kind": "decode", "format": fmt_name, "backend": backend, "label": label or f"{fmt_name}/{backend}",
           "hq": hq, "hkv": hkv, "d": d, "context": ctx, "batch": batch, "sets": case.sets,
           "calls_per_replay": len(replay_sets(case.sets)),
           "kv_bytes": case.kv_bytes(), "bytes": case.kv_bytes() + case.io_bytes(), **{k: v for k, v in extra.items()}}

    def call(i: int):
        return decode(case.q, case.kp, case.vp, case.tables[i], case.seq_lens, case.fmt, case.scale,
                      out=case.outs[i], **extra)

    try:
        out = case.outs[0]
        out.fill_(float("nan"))
        call(0)
        torch.cuda.synchronize()
        ref = paged_decode_ref(case.q, case.kp, case.vp, case.tables[0], case.seq_lens, case.fmt, case.scale)
        o = out.float()
        finite = bool(torch.isfinite(o).all())
        rel = float((o - ref).norm() / ref.norm().clamp_min(1e-30)) if finite else float("nan")
        tol = 2e-2 if fmt_name in ("bf16", "auto") else 1e-2
        row.update(rel_err=rel, tol=tol, correct=bool(finite and rel <= tol))
        del ref, o
        if not row["correct"]:
            row["error"] = f"wrong result: rel_err={rel:.3e} finite={finite}"
            return row, case
        us = time_graph([lambda i=i: call(i) for i in replay_sets(case.sets)], rep_ms)
        row.update(us=us, gbps=row["bytes"] / (us * 1e-6) / 1e9, pct_copy=100.0 * row["bytes"] / (us * 1e-6) / copy_bw)
    except Exception as e:  # report, keep the run going
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    return row, case


def bench_sdpa(backend_name: str, hq: int, hkv: int, d: int, ctx: int, batch: int, l2: int, rep_ms: int,
               copy_bw: float) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    per_set = 2 * batch * hkv * ctx * d * 2
    sets = sets_for(per_set, l2)
    row = {"kind": "decode", "format": "sdpa-bf16", "backend": backend_name, "label": f"sdpa-{backend_name}",
           "hq": hq, "hkv": hkv, "d": d, "context": ctx, "batch": batch, "sets": sets,
           "calls_per_replay": len(replay_sets(sets)),
           "kv_bytes": per_set, "bytes": per_set + 2 * batch * hq * d * 2}
    try:
        q = torch.randn(batch, hq, 1, d, dtype=torch.bfloat16, device="cuda")
        kv = [(torch.randn(batch, hkv, ctx, d, dtype=torch.bfloat16, device="cuda"),
               torch.randn(batch, hkv, ctx, d, dtype=torch.bfloat16, device="cuda")) for _ in range(sets)]

        def call(i: int):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, kv[i][0], kv[i][1], enable_gqa=True)

        out = call(0)
        torch.cuda.synchronize()
        # reference per (sequence, kv head): a GQA-expanded fp32 copy of K/V would not fit at 512K x 8
        g = hq // hkv
        ref = torch.empty(batch, hq, 1, d, dtype=torch.float32, device="cuda")
        for b_ in range(batch):
            for h in range(hkv):
                k0, v0 = kv[0][0][b_, h].float(), kv[0][1][b_, h].float()
                qg = q[b_, h * g:(h + 1) * g, 0].float()
                ref[b_, h * g:(h + 1) * g, 0] = torch.softmax((qg @ k0.T) * d ** -0.5, dim=-1) @ v0
        rel = float((out.float() - ref).norm() / ref.norm())
        row.update(rel_err=rel, tol=2e-2, correct=rel <= 2e-2)
        del k0, v0, ref
        us = time_graph([lambda i=i: call(i) for i in replay_sets(sets)], rep_ms)
        row.update(us=us, gbps=row["bytes"] / (us * 1e-6) / 1e9, pct_copy=100.0 * row["bytes"] / (us * 1e-6) / copy_bw)
        del q, kv
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    torch.cuda.empty_cache()
    return row


def store_slots(tokens: int, num_pages: int, pattern: str, device="cuda", generator=None):
    """Slots of a store: "pages" = whole pages in random order, offsets in sequence (what a
    prefill chunk writes); "scattered" = every token at a random slot (no write lands next to
    another: the partial-sector worst case)."""
    import torch

    if pattern == "scattered":
        return torch.randperm(num_pages * PAGE, device=device, generator=generator)[:tokens].to(torch.int64)
    pages = torch.randperm(num_pages, device=device, generator=generator)[: math.ceil(tokens / PAGE)]
    return (pages[:, None] * PAGE + torch.arange(PAGE, device=device)).flatten()[:tokens].to(torch.int64)


def bench_store(fmt_name: str, hkv: int, d: int, tokens: int, rep_ms: int, copy_bw: float) -> dict:
    import torch

    from ninfer.attention.selector import OpContext, select_ops
    from ninfer.kvcache.formats import get_format

    fmt = get_format(fmt_name)
    row = {"kind": "store", "format": fmt_name, "hkv": hkv, "d": d, "tokens": tokens}
    try:
        # the store the engine would run for this format and geometry (CUDA C++ for the 4-bit formats)
        store_kv = select_ops(OpContext(fmt, torch.device("cuda"), torch.bfloat16, d, None, hkv, PAGE))["store"].fn
        num_pages = math.ceil(tokens / PAGE) * 8
        planes = {pl.name: torch.zeros(num_pages, hkv, PAGE, pl.extent, dtype=pl.dtype, device="cuda")
                  for pl in fmt.planes(d, torch.bfloat16)}
        sets = 8
        ks = [torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
        vs = [torch.randn(tokens, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
        bytes_ = 2 * tokens * hkv * d * 2 + tokens * hkv * fmt.bytes_per_token_head(d, torch.bfloat16) + tokens * 8
        for pattern in ("pages", "scattered"):
            slots = [store_slots(tokens, num_pages, pattern) for _ in range(sets)]
            us = time_graph([lambda i=i: store_kv(ks[i], vs[i], planes, slots[i]) for i in range(sets)], rep_ms)
            if pattern == "pages":
                row.update(us=us, bytes=bytes_, gbps=bytes_ / (us * 1e-6) / 1e9,
                           pct_copy=100.0 * bytes_ / (us * 1e-6) / copy_bw)
            else:
                row.update(us_scattered=us, pct_copy_scattered=100.0 * bytes_ / (us * 1e-6) / copy_bw)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    torch.cuda.empty_cache()
    return row


def bench_prefill(fmt_name: str, hq: int, hkv: int, d: int, ctx: int, chunk: int, rep_ms: int, copy_bw: float) -> dict:
    import torch

    from ninfer.kernels.prefill import paged_prefill_triton

    row = {"kind": "prefill", "format": fmt_name, "hq": hq, "hkv": hkv, "d": d, "context": ctx, "chunk": chunk}
    try:
        case = DecodeCase(fmt_name, hq, hkv, d, ctx + chunk, 1, 1, seed=1)
        q = torch.randn(chunk, hq, d, dtype=torch.bfloat16, device="cuda")
        qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        us = time_graph([lambda: paged_prefill_triton(q, case.kp, case.vp, qsl, case.seq_lens, case.tables[0], chunk,
                                                       case.fmt, case.scale, out=out)], rep_ms)
        flops = 4.0 * chunk * hq * d * (ctx + chunk / 2)
        row.update(us=us, kv_bytes=case.kv_bytes(), tflops=flops / (us * 1e-6) / 1e12)
        del case
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    torch.cuda.empty_cache()
    return row


def run(args) -> int:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        print("ninfer bench kernels: needs a CUDA GPU (kernel speed is never measured on CPU)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
    if args.quick and args.contexts == "32k,128k" and args.batch == "1":
        args.contexts = "128k"  # --quick: 128K x batch 1 unless contexts/batch are given
    contexts = [_tokens(c) for c in args.contexts.split(",") if c.strip()]
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    geos = [g.strip() for g in args.geometries.split(",") if g.strip()]
    rep = max(30, args.rep_ms // 3) if args.quick else args.rep_ms
    t_start = time.time()
    result = {"bench": "kernels", "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "gpu": props.name, "sm_count": props.multi_processor_count, "l2_bytes": l2,
              "torch": torch.__version__, "command": " ".join(["ninfer", "bench", "kernels"] + sys.argv[3:]),
              "rows": []}
    import triton
    result["triton"] = triton.__version__
    copy_bw = copy_bandwidth(rep)
    result["copy_bw_GBps"] = copy_bw / 1e9
    print(f"# {props.name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write), L2 {l2 >> 20} MiB", flush=True)
    rows = result["rows"]
    for geo in geos:
        hq, hkv, d = GEOMETRIES[geo]
        for ctx in contexts:
            for bsz in batches:
                for fmt_name in formats:
                    case = None
                    for be in (["triton"] if fmt_name in ("bf16", "auto") else backends):
                        row, case = bench_decode_format(fmt_name, be, hq, hkv, d, ctx, bsz, l2, rep, copy_bw, case=case)
                        rows.append(row)
                        print(f"  {geo} {ctx // 1024}k B={bsz} {row['label']}: "
                              f"{_fmt(row.get('us'), '.1f')} us rel={_fmt(row.get('rel_err'), '.1e')} "
                              f"{row.get('error', '')[:120]}", flush=True)
                    del case
                    torch.cuda.empty_cache()
                if not args.no_sdpa:
                    for be in ("flash", "cudnn"):
                        row = bench_sdpa(be, hq, hkv, d, ctx, bsz, l2, rep, copy_bw)
                        rows.append(row)
                        print(f"  {geo} {ctx // 1024}k B={bsz} sdpa-{be}: {_fmt(row.get('us'), '.1f')} us "
                              f"{row.get('error', '')[:120]}", flush=True)
    add_ratios(rows)
    if not args.no_store:
        if importlib.util.find_spec("ninfer.kernels.store_kv") is None:
            rows.append({"kind": "absent", "what": "store_kv", "why": "ninfer/kernels/store_kv.py not present"})
        else:
            for geo in geos:
                hq, hkv, d = GEOMETRIES[geo]
                for fmt_name in formats:
                    rows.append(bench_store(fmt_name, hkv, d, 16384, rep, copy_bw))
    if not args.no_prefill:
        if importlib.util.find_spec("ninfer.kernels.prefill") is None:
            rows.append({"kind": "absent", "what": "paged_prefill", "why": "ninfer/kernels/prefill.py not present"})
        else:
            pctx = 128 * 1024 if not args.quick else 32 * 1024
            for geo in geos:
                hq, hkv, d = GEOMETRIES[geo]
                prs = [bench_prefill(f, hq, hkv, d, pctx, args.prefill_chunk, rep, copy_bw) for f in formats]
                base = [r["us"] for r in prs if r["format"] == "int8" and "us" in r]
                for r in prs:
                    if "us" in r and base:
                        r["x_int8"] = r["us"] / base[0]
                rows.extend(prs)
    result["wall_s"] = time.time() - t_start
    txt = table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result, indent=1))
    print(txt)
    return 0 if all(r.get("correct", True) for r in rows) else 1
