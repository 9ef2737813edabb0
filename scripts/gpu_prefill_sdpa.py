"""GPU check and timing of the SDPA prefill path (ninfer/attention/prefill_sdpa.py), one device command.

  python3 scripts/gpu_prefill_sdpa.py [--out DIR] [--skip-kernels] [--profile-layers N]

1. Correctness on the GPU, every format, GQA 1/4/6/8, D 64/128/256, a varlen batch of two
   sequences (one with 5000 cached tokens crossing pages, one starting empty), small KV chunks so
   partial results are merged: the dequantize kernel bit-exact against its torch oracle, and
   prefill_sdpa (cuDNN and flash) against the float32 oracle paged_prefill_ref.
2. The kernel table (ninfer.bench.prefill.kernel_rows): both geometries, N = 32K and 128K, 4096-token
   chunk, SDPA flash / cuDNN bf16 vs ninfer's SDPA path (cuDNN first, flash only) and Triton kernel.
3. Where the time goes at 128K: the dequantize pass alone, the unmasked folded call alone, and
   KV chunks of 32K / 64K / 128K.
4. --profile-layers N: a random Qwen3-8B geometry with N layers, one 32K prefill per kv-dtype under
   the torch profiler: the top CUDA kernels and CUDA-busy time vs wall time (per-chunk overheads).
JSON to --out (default $OUT); a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.attention import prefill_sdpa as PS  # noqa: E402
from ninfer.kernels.dequant_pages import dequant_pages, dequant_pages_ref  # noqa: E402
from ninfer.kernels.prefill import paged_prefill_ref  # noqa: E402
from ninfer.kernels.store_kv import store_kv_triton  # noqa: E402
from ninfer.kvcache.formats import get_format  # noqa: E402
from ninfer.kvcache.pool import KVCachePool  # noqa: E402

FORMATS = ("auto", "bf16", "int8", "rk4v4", "rk4v4-e8")
SHAPES = ((8, 8, 64), (16, 4, 128), (24, 4, 256), (32, 4, 128))  # GQA 1, 4, 6, 8
PAGE = 64


def check(fmt: str, hq: int, hkv: int, d: int, seed: int, dev: torch.device, small: bool = False) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    ctx, qlens = ((150, 0), (40, 21)) if small else ((5000, 0), (1000, 777))
    span = 100 if small else 3000
    sl = [c + q for c, q in zip(ctx, qlens)]
    pages = [-(-n // PAGE) for n in sl]
    pool = KVCachePool(fmt, 1, hkv, d, sum(pages), PAGE, dev, torch.bfloat16)
    planes = pool.layers[0]
    perm = torch.randperm(sum(pages), device=dev, generator=g).to(torch.int32)
    bt = torch.full((2, max(pages)), -1, dtype=torch.int32, device=dev)
    bt[0, :pages[0]], bt[1, :pages[1]] = perm[:pages[0]], perm[pages[0]:]
    for b in range(2):  # store every token of both sequences (cached prefix and chunk)
        t = torch.arange(sl[b], device=dev)
        slots = (bt[b].long()[t // PAGE] * PAGE + t % PAGE)
        k = torch.randn(sl[b], hkv, d, device=dev, generator=g).to(torch.bfloat16)
        v = torch.randn(sl[b], hkv, d, device=dev, generator=g).to(torch.bfloat16)
        store_kv_triton(k, v, planes, slots, get_format(fmt))
    q = torch.randn(sum(qlens), hq, d, device=dev, generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32, device=dev)
    slt = torch.tensor(sl, dtype=torch.int32, device=dev)
    ref = paged_prefill_ref(q.float(), planes, planes, qsl, slt, bt, max(qlens), get_format(fmt), d ** -0.5).float()
    res = {"format": fmt, "hq": hq, "hkv": hkv, "d": d}
    ko = torch.full((hkv, span, d), float("nan"), dtype=torch.bfloat16, device=dev)
    vo = ko.clone()
    dequant_pages(planes, fmt, bt[0], 37, span, ko, vo)
    kr, vr = dequant_pages_ref(planes, fmt, bt[0], 37, span, torch.bfloat16)
    res["dequant_exact"] = bool(torch.equal(ko, kr) and torch.equal(vo, vr))
    for name, order in (("cudnn", ("cudnn",)), ("flash", ("flash",))):
        try:
            out = torch.full_like(q, float("nan"))
            PS.prefill_sdpa(q, planes, fmt, list(qlens), sl, bt, d ** -0.5, out=out, kv_chunk=64 if small else 2048,
                            order=order)
            res[f"rel_{name}"] = float((out.float() - ref).norm() / ref.norm())
        except RuntimeError as e:
            res[f"rel_{name}"] = f"error: {str(e)[:160]}"
    return res


def breakdown(fmt: str, hq: int, hkv: int, d: int, n: int, chunk: int) -> dict:
    from ninfer.bench.kernels import random_planes
    from ninfer.bench.prefill import _median_ms
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    seq = n + chunk
    npg = -(-seq // PAGE)
    planes = random_planes(get_format(fmt), d, hkv, npg, dev, g)
    bt = torch.randperm(npg, device=dev, generator=g).to(torch.int32)[None]
    q = torch.randn(chunk, hq, d, dtype=torch.bfloat16, device=dev, generator=g)
    ws = torch.empty(2, hkv, n, d, dtype=torch.bfloat16, device=dev)
    r = {"format": fmt, "geometry": f"{hq}q/{hkv}kv/D{d}", "context": n}
    r["dequant_ms"] = _median_ms(lambda: dequant_pages(planes, fmt, bt[0], 0, n, ws[0], ws[1]))
    moved = 2 * hkv * n * d * 2 + n * hkv * get_format(fmt).bytes_per_token_head(d)  # bf16 written + pages read
    r["dequant_GBps"] = moved / r["dequant_ms"] / 1e6
    qf = q.view(chunk, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(1, hkv, -1, d)
    for be in ("cudnn", "flash"):
        try:
            r[f"fold_{be}_ms"] = _median_ms(lambda: PS.sdpa_lse(qf, ws[0:1], ws[1:2], False, d ** -0.5, (be,)))
        except RuntimeError as e:
            r[f"fold_{be}_ms"] = f"error: {str(e)[:120]}"
    flops = 4.0 * hq * d * chunk * (n + chunk / 2)
    for kvc in (32768, 65536, 1 << 20):
        ms = _median_ms(lambda: PS.prefill_sdpa(q, planes, fmt, [chunk], [seq], bt, d ** -0.5, kv_chunk=kvc))
        r[f"kv_chunk_{kvc}_ms"] = ms
        r[f"kv_chunk_{kvc}_tflops"] = flops / ms / 1e9
    return r


def profile(layers: int, kvs: list[str], n: int) -> list[dict]:
    from ninfer.bench import _timing as T
    from ninfer.config import EngineConfig
    from ninfer.models.random_checkpoint import write_random_checkpoint
    d = Path("/tmp/ninfer-prof-ckpt")
    if not (d / "config.json").is_file():
        write_random_checkpoint(d, "qwen3-8b", device="cuda", overrides={"num_hidden_layers": layers})
    out = []
    for kv in kvs:
        eng = T.start_engine(EngineConfig(model=str(d), kv_dtype=kv, max_context=n + 64, enable_prefix_caching=False))
        vocab = eng.model_config.vocab_size
        T.timed_request(eng, "w", T.random_prompt(vocab, n, body_seed=1, head_seed=0), 1)
        plain = T.timed_request(eng, "t", T.random_prompt(vocab, n, body_seed=1, head_seed=3), 1)["ttft_s"]
        from torch.profiler import ProfilerActivity, profile as tprof
        with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            r = T.timed_request(eng, "p", T.random_prompt(vocab, n, body_seed=1, head_seed=5), 1)
            wall = time.perf_counter() - t0
        busy = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 1e6
        top = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:22]
        out.append({"kv": kv, "layers": layers, "prompt": n, "ttft_s": plain,
                    "profiled_ttft_s": r["ttft_s"], "wall_s": wall,
                    "cuda_busy_s": busy, "top": [{"name": e.key[:90], "ms": e.self_device_time_total / 1e3,
                                                  "calls": e.count} for e in top]})
        del eng
        T.release()
    return out


def save(out: str, res: dict) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "prefill_sdpa_gpu.json").write_text(json.dumps(res, indent=1, default=str))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--profile-layers", type=int, default=0)
    ap.add_argument("--shapes", default="all", help="all, or comma-separated indices into SHAPES")
    ap.add_argument("--quick-kernels", action="store_true", help="kernel table without the flash-only and Triton rows")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny checks on CPU (TRITON_INTERPRET=1) only")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.cpu_dry_run else "cuda")
    t_start = time.perf_counter()
    res: dict = {"torch": torch.__version__, "gpu": None if a.cpu_dry_run else torch.cuda.get_device_name(0),
                 "cudnn": torch.backends.cudnn.version()}
    checks = []
    for i, fmt in enumerate(FORMATS):
        for j, (hq, hkv, d) in enumerate(SHAPES):
            if a.shapes != "all" and str(j) not in a.shapes.split(","):
                continue
            try:
                checks.append(check(fmt, hq, hkv, d, 100 * i + j, dev, a.cpu_dry_run))
            except Exception as e:
                checks.append({"format": fmt, "hq": hq, "hkv": hkv, "d": d, "error": f"{type(e).__name__}: {e}"[:300]})
            print("CHECK", json.dumps(checks[-1]), flush=True)
    res["checks"] = checks
    save(a.out, res)
    print(f"checks done {time.perf_counter() - t_start:.0f} s", flush=True)
    if not a.skip_kernels and not a.cpu_dry_run:
        from ninfer.bench.prefill import kernel_rows, kernel_table
        rows = kernel_rows([32768, 131072], ["bf16", "int8", "rk4v4-e8"], 4096,
                           orders={"": None} if a.quick_kernels else {"": None, "flash": ("flash",)},
                           triton_too=not a.quick_kernels)
        res["kernels"] = rows
        save(a.out, res)
        print(f"kernels done {time.perf_counter() - t_start:.0f} s", flush=True)
        res["breakdown"] = [breakdown("rk4v4-e8", hq, hkv, d, 131072, 4096) for hq, hkv, d in ((32, 8, 128), (24, 4, 256))]
        for b in res["breakdown"]:
            print("BREAKDOWN", json.dumps(b), flush=True)
        save(a.out, res)
    if a.profile_layers:
        res["profile"] = profile(a.profile_layers, ["rk4v4-e8"], 32768)
        for p in res["profile"]:
            print("PROFILE", json.dumps({k: v for k, v in p.items() if k != "top"}))
            for t in p["top"]:
                print(f"   {t['ms']:9.2f} ms {t['calls']:6d}x {t['name']}")
    save(a.out, res)
    bad = [c for c in checks if "error" in c or not c.get("dequant_exact")
           or any(not isinstance(c.get(k), float) or not c[k] < 2e-2 for k in ("rel_cudnn", "rel_flash"))]
    print(f"== checks: {len(checks) - len(bad)}/{len(checks)} ok (dequant bit-exact, rel < 2e-2)")
    for c in bad:
        print("BAD", json.dumps(c))
    print("max rel cudnn/flash:", *(max((c[k] for c in checks if isinstance(c.get(k), float)), default=None)
                                    for k in ("rel_cudnn", "rel_flash")))
    if "kernels" in res:
        print(kernel_table(res["kernels"]))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
