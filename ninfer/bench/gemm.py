"""Quantized-weight GEMMs vs bf16 (GPU): at Qwen3-8B's linear shapes and decode/prefill batch sizes,
bf16 ``torch.matmul``, every FP8 block-scaled path (the weight-only GEMV and tl.dot kernels, Triton
W8A8, cuBLAS blockwise ``scaled_mm`` where it runs, and the default the module picks) and NVFP4
(GEMV, tl.dot, default). GEMV rows also report the tile config its one-time timing chose, and the
run ends with the faster weight-only path per shape and M (where the GEMV threshold belongs).

Per row: correctness first (relative Frobenius error against an fp32 matmul of the dequantized
weight; a row over its bound is reported and not timed), then the median time of CUDA-graph
replays over weight copies that together are at least 4x the L2 (no call reads its weight from
L2), after a read flush (``kernel_timing.median_us``). Reported: us, TFLOP/s (2MNK), the weight
bytes read (data + scales) per second, and that as a percent of the device copy bandwidth
(bytes read + written) measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from ninfer.bench.kernel_timing import copy_bandwidth, replay_sets, time_graph

# Qwen3-8B: hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288 -> (K, N)
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
IMPLS = ("bf16", "fp8-gemv", "fp8-weight-only", "fp8-triton", "fp8-scaled-mm", "fp8-auto", "nvfp4-gemv", "nvfp4-dot",
         "nvfp4-auto")
FORCED = {"fp8-gemv": "gemv", "fp8-weight-only": "weight_only", "fp8-triton": "triton", "fp8-scaled-mm": "scaled_mm",
          "nvfp4-gemv": "gemv", "nvfp4-dot": "dot"}
TOL = {"bf16": 1e-2, "fp8-gemv": 1e-2, "fp8-weight-only": 1e-2}  # NVFP4 too; W8A8 rows: 6e-2 (e4m3 activations)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH", help="write the result as JSON to PATH ('-' = stdout)")
    p.add_argument("--m", default="1,2,4,8,16,32,64,4096", help="comma list of batch rows M")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of implementations to time")
    p.add_argument("--rep-ms", type=int, default=100, help="ms of timed replays per measurement")


def make_weights(impl: str, n: int, k: int, gen, dev) -> tuple[tuple, int]:
    """Random weights of the format (valid codes, realistic scales) and the bytes a call reads."""
    import torch
    if impl == "bf16":
        w = (torch.randn((n, k), device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        return (w,), w.numel() * 2
    if impl.startswith("fp8"):
        w = (torch.randn((n, k), device=dev, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand((-(-n // 128), -(-k // 128)), device=dev, generator=gen) * 4e-4 + 1e-4
        return (w, s), w.numel() + s.numel() * 4
    p = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
    sc = (torch.rand((n, k // 16), device=dev, generator=gen) * 200 + 8).to(torch.float8_e4m3fn)
    gs = torch.tensor([448.0 * 6 / 0.1], device=dev)
    return (p, sc, gs), p.numel() + sc.numel()


def dequantized(impl: str, args: tuple):
    """The fp32 weight a call means (its reference)."""
    import torch
    from ninfer.kernels import fp8_gemm, nvfp4_gemm
    if impl == "bf16":
        return args[0].float()
    if impl.startswith("fp8"):
        return fp8_gemm.dequantize_ref(*args, dtype=torch.float32)
    return nvfp4_gemm.dequantize_ref(*args, dtype=torch.float32)


def call(impl: str):
    import torch
    from ninfer.kernels.fp8_gemm import fp8_block_linear
    from ninfer.kernels.nvfp4_gemm import nvfp4_linear
    if impl == "bf16":
        return lambda x, w: torch.matmul(x, w.t())
    if impl.startswith("nvfp4"):
        return lambda x, p, sc, gs: nvfp4_linear(x, p, sc, gs, impl=FORCED.get(impl))
    return lambda x, w, s: fp8_block_linear(x, w, s, impl=FORCED.get(impl))


def bench_row(impl: str, shape: str, m: int, l2: int, rep_ms: int, copy_bw: float) -> dict:
    import torch
    from ninfer.kernels import qgemv
    from ninfer.kernels.fp8_gemm import scaled_mm_supported
    k, n = SHAPES[shape]
    dev = torch.device("cuda")
    row = {"impl": impl, "shape": shape, "m": m, "k": k, "n": n}
    if impl == "fp8-scaled-mm" and not scaled_mm_supported(n, k):
        return {**row, "error": "shape not supported by blockwise scaled_mm"}
    if impl.endswith("gemv") and m > qgemv.MAX_M:
        return {**row, "error": f"the GEMV takes M <= {qgemv.MAX_M}"}
    gen = torch.Generator(device=dev).manual_seed(1000 * m + n + k)
    x = torch.randn((m, k), device=dev, generator=gen).to(torch.bfloat16)
    first, nbytes = make_weights(impl, n, k, gen, dev)
    fn = call(impl)
    try:
        y = fn(x, *first).float()
        ref = x.float() @ dequantized(impl, first).t()
        row["rel_err"] = float((y - ref).norm() / ref.norm())
        del y, ref
    except Exception as e:  # e.g. cuBLAS without blockwise fp8: reported, the other rows still run
        return {**row, "error": _why(e)}
    row["correct"] = row["rel_err"] < TOL.get(impl, 1e-2 if impl.startswith("nvfp4") else 6e-2)
    cfg = qgemv.chosen(impl.split("-")[0], dev, m, n, k) if impl.endswith("gemv") else None
    if cfg:
        row["config"] = list(cfg)  # (BLOCK_N, BLOCK_K, warps, programs per SM, stages)
    if not row["correct"]:
        return row
    row["weight_bytes"] = nbytes
    sets = max(1, -(-4 * l2 // nbytes))
    weights = [first] + [make_weights(impl, n, k, gen, dev)[0] for _ in range(sets - 1)]
    us = time_graph([lambda i=i: fn(x, *weights[i]) for i in replay_sets(sets)], rep_ms)
    row.update(us=us, tflops=2.0 * m * n * k / (us * 1e-6) / 1e12, weight_GBps=nbytes / (us * 1e-6) / 1e9)
    row["pct_copy"] = 100.0 * row["weight_GBps"] * 1e9 / copy_bw
    return row


def _why(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _write(path: str | None, result: dict) -> None:
    if path and path != "-":
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


def table(rows: list[dict]) -> str:
    lines = [f"{'shape':<8}{'M':>6}  {'impl':<17}{'us':>9}{'TFLOP/s':>9}{'wGB/s':>8}{'%copy':>7}{'rel_err':>9}"]
    for r in rows:
        f = lambda key, spec: format(r[key], spec) if r.get(key) is not None else "-"  # noqa: E731
        lines.append(f"{r['shape']:<8}{r['m']:>6}  {r['impl']:<17}{f('us', '.1f'):>9}{f('tflops', '.1f'):>9}"
                     f"{f('weight_GBps', '.0f'):>8}{f('pct_copy', '.0f'):>7}{f('rel_err', '.1e'):>9}"
                     + (f"  {r['error']}" if "error" in r else "") + ("  WRONG" if r.get("correct") is False else "")
                     + (f"  config {r['config']}" if "config" in r else ""))
    return "\n".join(lines)


def crossover(rows: list[dict]) -> list[str]:
    """Per format and shape, the M at which each weight-only path (GEMV, tl.dot) was the faster."""
    pairs = {"fp8": ("fp8-gemv", "fp8-weight-only"), "nvfp4": ("nvfp4-gemv", "nvfp4-dot")}
    us = {(r["impl"], r["shape"], r["m"]): r["us"] for r in rows if r.get("us") is not None}
    lines = []
    for fmt, (gemv, dot) in pairs.items():
        for shape in dict.fromkeys(r["shape"] for r in rows):
            ms = sorted({m for (i, s, m) in us if s == shape and i == gemv and (dot, s, m) in us})
            if ms:
                win = {m: "gemv" if us[(gemv, shape, m)] <= us[(dot, shape, m)] else "dot" for m in ms}
                lines.append(f"# {fmt} {shape}: GEMV faster at M = {[m for m in ms if win[m] == 'gemv']}, "
                             f"tl.dot at M = {[m for m in ms if win[m] == 'dot']}")
    return lines


def run(args) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("ninfer bench gemm: needs a CUDA GPU (kernel speed is never measured on CPU)", file=sys.stderr)
        return 2
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES] + [i for i in impls if i not in IMPLS]
    if bad:
        print(f"ninfer bench gemm: unknown shape/impl {bad}; shapes {list(SHAPES)}, impls {list(IMPLS)}",
              file=sys.stderr)
        return 2
    ms = [int(s) for s in args.m.split(",") if s.strip()]
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
    t0 = time.time()
    from ninfer.kernels.fp8_gemm import prefill_impl
    try:
        choice = prefill_impl(torch.device("cuda", 0))
    except Exception as e:  # the Triton W8A8 kernel itself failed: its rows say so too
        choice = f"none ({_why(e)})"
    copy_bw = copy_bandwidth(args.rep_ms)
    result = {"bench": "gemm", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": props.name,
              "torch": torch.__version__, "triton": triton.__version__, "l2_bytes": l2,
              "command": " ".join(["ninfer", "bench", "gemm"] + sys.argv[3:]), "copy_bw_GBps": copy_bw / 1e9,
              "fp8_prefill_impl": choice, "rows": []}
    print(f"# {props.name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read+write); fp8 prefill uses {choice}",
          flush=True)
    for shape in shapes:
        for m in ms:
            for impl in impls:
                row = bench_row(impl, shape, m, l2, args.rep_ms, copy_bw)
                torch.cuda.empty_cache()  # the row's weight copies
                result["rows"].append(row)
                _write(args.json, result)  # after every row: a cut-short run keeps what it measured
                print(table([row]).splitlines()[1], flush=True)
    result["wall_s"] = time.time() - t0
    result["crossover"] = crossover(result["rows"])
    print(table(result["rows"]))
    print("\n".join(result["crossover"]))
    if args.json == "-":
        print(json.dumps(result, indent=1))
    _write(args.json, result)
    return 0 if all(r.get("correct", True) for r in result["rows"]) else 1
