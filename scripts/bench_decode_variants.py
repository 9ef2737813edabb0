"""Decode-kernel variants on the GPU in one call: correctness at small odd shapes (CUDA and Triton
paths vs the torch oracle), then at 128K x batch 1 for both geometries every variant timed side by
side with SDPA bf16 (flash, cuDNN) and the int8 control; compiler resource reports last.

    PYTHONPATH=$PWD python3 scripts/bench_decode_variants.py --out $OUT/variants.json

Variants: Triton (num_warps 4/8), CUDA (warps, chunk tokens per stage, stages) configurations,
split counts. Prints a short table last; the JSON holds every row.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.bench import kernels as kb  # noqa: E402
from ninfer.kernels import paged_decode as pd  # noqa: E402
from ninfer.kvcache.formats import get_format  # noqa: E402

CUDA_CFGS = {
    "int8": [(8, 16, 3), (4, 16, 4)],
    "rk4v4": [(8, 32, 2)],
    "rk4v4-e8": [(8, 32, 2), (8, 32, 3), (4, 32, 4)],
}


def small_checks() -> list[dict]:
    """Odd lengths, page/chunk boundaries, zero length, GQA 1/4/6/8, D 128/256, both paths."""
    out = []
    torch.manual_seed(0)
    shapes = [(6, 1, 256, [131, 1, 0, 4097]), (8, 2, 128, [64, 65, 200]), (4, 4, 128, [33]),
              (8, 1, 256, [1000, 31])]
    for fmt in ("int8", "rk4v4", "rk4v4-e8"):  # Triton: interpreter tests + the 128K rows below
        for hq, hkv, d, lens in shapes:
            bsz = len(lens)
            ctx = max(lens)
            case = kb.DecodeCase(fmt, hq, hkv, d, ctx, bsz, 1, seed=hq + d)
            case.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            # poison unwritten slots' scales: a kernel must not let them reach the output
            if "v_scale" in case.planes:
                pages_used = case.tables[0]
                for b, n in enumerate(lens):
                    if n % 64:
                        pg = pages_used[b, n // 64].long()
                        case.planes["v_scale"][pg, :, n % 64:] = float("nan")
                        case.planes["k_scale"][pg, :, n % 64:] = float("inf")
            ref = pd.paged_decode_ref(case.q, case.kp, case.vp, case.tables[0], case.seq_lens, case.fmt, case.scale)
            for be, splits in (("cuda", None), ("cuda", 3)):
                if be == "cuda" and fmt == "bf16":
                    continue
                o = torch.full_like(case.q, float("nan"))
                row = {"fmt": fmt, "backend": be, "hq": hq, "hkv": hkv, "d": d, "lens": lens, "splits": splits}
                try:
                    decode = pd.paged_decode_cuda if be == "cuda" else pd.paged_decode_triton
                    decode(case.q, case.kp, case.vp, case.tables[0], case.seq_lens, case.fmt, case.scale,
                           out=o, num_splits=splits)
                    torch.cuda.synchronize()
                    of = o.float()
                    fin = bool(torch.isfinite(of).all())
                    rel = float((of - ref).norm() / ref.norm()) if fin else float("nan")
                    zero_ok = all(bool((of[b] == 0).all()) for b, n in enumerate(lens) if n == 0)
                    row.update(rel=rel, finite=fin, zero_ok=zero_ok,
                               ok=fin and zero_ok and rel <= (2e-2 if fmt == "bf16" else 1e-2))
                    if not row["ok"]:
                        # per-sequence errors help locate a mapping bug
                        row["rel_per_seq"] = [float((of[b] - ref[b]).norm() / ref[b].norm().clamp_min(1e-30))
                                              for b in range(bsz)]
                except Exception as e:
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                out.append(row)
            del case
    return out


def triton_info() -> list[dict]:
    info = []
    kern = pd._paged_decode_split_kernel
    try:
        for dev, caches in getattr(kern, "device_caches", {}).items():
            cache = caches[0] if isinstance(caches, tuple) else caches
            for key, ck in cache.items():
                md = getattr(ck, "metadata", None)
                info.append({"key": str(key)[-200:], "n_regs": getattr(ck, "n_regs", None),
                             "n_spills": getattr(ck, "n_spills", None),
                             "shared": getattr(md, "shared", None), "num_warps": getattr(md, "num_warps", None)})
    except Exception as e:
        info.append({"error": repr(e)})
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="variants.json")
    ap.add_argument("--rep-ms", type=int, default=80)
    ap.add_argument("--contexts", default="128k")
    ap.add_argument("--skip-small", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    l2 = int(props.L2_cache_size)
    cap = torch.cuda.get_device_capability(0)
    arch = f"sm_{cap[0]}{cap[1]}"
    keys = []
    for fmt, cfgs in CUDA_CFGS.items():
        code = get_format(fmt).kernel_code
        for d in (128, 256):
            for cfg in cfgs:
                keys.append((code, d, "bf16", *cfg))
    with ThreadPoolExecutor(8) as ex:
        errs = list(ex.map(lambda k: _try_build(k, arch), keys))
    build_errors = [e for e in errs if e]
    print(f"# cubins ready in {time.time() - t0:.1f}s, {len(build_errors)} build errors", flush=True)
    for e in build_errors[:3]:
        print(e[:2000])
    res = {"gpu": props.name, "arch": arch, "build_errors": build_errors}
    copy_bw = kb.copy_bandwidth(args.rep_ms)
    res["copy_bw_GBps"] = copy_bw / 1e9
    print(f"# copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    if not args.skip_small:
        res["small"] = small_checks()
        bad = [r for r in res["small"] if not r.get("ok")]
        print(f"# small checks: {len(res['small']) - len(bad)}/{len(res['small'])} ok", flush=True)
        for r in bad[:12]:
            print("  FAIL", json.dumps(r)[:400], flush=True)
    rows = []
    for ctx_s in args.contexts.split(","):
        ctx = kb._tokens(ctx_s)
        for geo, (hq, hkv, d) in kb.GEOMETRIES.items():
            for fmt in ("bf16", "int8", "rk4v4", "rk4v4-e8"):
                case = None
                variants = [("triton", {"num_warps": 4, "label": f"{fmt}/triton-w4"})]
                if fmt in ("int8", "rk4v4-e8"):
                    variants.append(("triton", {"num_warps": 8, "label": f"{fmt}/triton-w8"}))
                if fmt != "bf16":
                    for cfg in CUDA_CFGS[fmt]:
                        variants.append(("cuda", {"cuda_cfg": cfg, "label": f"{fmt}/cuda-{cfg[0]}w{cfg[1]}c{cfg[2]}s"}))
                    if fmt == "rk4v4-e8":
                        cfg = CUDA_CFGS[fmt][0]
                        try:
                            s0 = pd.cuda_num_splits(1, hkv, math.ceil(ctx / 64), torch.device("cuda"), get_format(fmt), d,
                                                   cfg=cfg)
                            variants.append(("cuda", {"cuda_cfg": cfg, "num_splits": 2 * s0,
                                                      "label": f"{fmt}/cuda-default-x2splits"}))
                        except Exception as e:
                            print("splits probe failed", e)
                for be, extra in variants:
                    row, case = kb.bench_decode_format(fmt, be, hq, hkv, d, ctx, 1, l2, args.rep_ms, copy_bw,
                                                       extra=extra, case=case)
                    if "cuda_cfg" in row:
                        row["cuda_cfg"] = list(row["cuda_cfg"])
                    rows.append(row)
                    print(f"  {geo} {row['label']}: {kb._fmt(row.get('us'), '.1f')} us "
                          f"{kb._fmt(row.get('pct_copy'), '.1f')}% rel={kb._fmt(row.get('rel_err'), '.1e')} "
                          f"{row.get('error', '')[:160]}", flush=True)
                del case
                torch.cuda.empty_cache()
            for be in ("flash", "cudnn"):
                row = kb.bench_sdpa(be, hq, hkv, d, ctx, 1, l2, args.rep_ms, copy_bw)
                rows.append(row)
                print(f"  {geo} sdpa-{be}: {kb._fmt(row.get('us'), '.1f')} us {row.get('error', '')[:160]}", flush=True)
    kb.add_ratios(rows)
    res["rows"] = rows
    info = {}
    for fmt, cfgs in CUDA_CFGS.items():
        for d in (128, 256):
            for cfg in cfgs:
                try:
                    info[f"{fmt}-d{d}-{cfg}"] = pd.cuda_kernel_info(get_format(fmt), d, torch.device("cuda"), cfg=cfg)
                except Exception as e:
                    info[f"{fmt}-d{d}-{cfg}"] = {"error": str(e)[:200]}
    res["cuda_info"] = info
    res["triton_info"] = triton_info()
    res["wall_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("# cuda kernels:", json.dumps(info)[:1500])
    print("# triton kernels:", json.dumps(res["triton_info"])[:1500])
    print(kb.table(rows))
    print(f"# wall {res['wall_s']:.0f}s")
    return 0


def _try_build(key, arch):
    try:
        pd._CUDA.build(key, arch)
        return None
    except Exception as e:
        return f"{key}: {e}"


if __name__ == "__main__":
    sys.exit(main())
