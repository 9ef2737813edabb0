"""Prefill speed: TTFT and prefill tok/s per --kv-dtype at given prompt lengths, HF transformers on the
same checkpoint and prompts as the outside reference, and the prefill attention kernels against torch
SDPA (flash, cuDNN) on the same shapes.

End to end: one engine per kv-dtype (prefix reuse off), a warm-up request (--warmup-tokens, default
the shortest prompt), then --repeats requests per prompt length, each a fresh random prompt whose head varies per
repeat; one generated token, so TTFT is the whole chunked prefill. `--peer transformers` runs the same
prompts in a subprocess: AutoModelForCausalLM in bf16 with attn_implementation="sdpa", one forward with
logits_to_keep=1. "% of ideal" is the model's prefill FLOPs (matmuls + causal attention) over the
measured bf16 matmul rate (an 8192^3 product on random data).

Kernels (CUDA): a --chunk-tokens chunk over N cached tokens, causal in the chunk, batch 1. ninfer's
SDPA path (ninfer/attention/prefill_sdpa.py) and Triton kernel per format, FLOPs 4 Hq D chunk
(N + chunk/2); torch SDPA bf16 one unmasked call of the chunk over N keys already expanded to the
query heads, FLOPs 4 Hq D chunk N (the same work without the diagonal block, in the layout SDPA
likes best). Medians of CUDA-event timings.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from ninfer.bench import _timing as T
from ninfer.config import parse_token_count

GEOMETRIES = {"24q/4kv/D256": (24, 4, 256), "32q/8kv/D128": (32, 8, 128)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    T.add_common_arguments(p, kv_default="int8,rk4v4-e8")
    b = p.add_argument_group("benchmark")
    b.add_argument("--prompt-tokens", default="32K,90000", help="comma-separated prompt lengths (default %(default)s)")
    b.add_argument("--repeats", type=int, default=3, help="timed requests per prompt length (median)")
    b.add_argument("--warmup-tokens", type=parse_token_count, default=None,
                   help="warm-up prompt per engine (default: the shortest prompt length)")
    b.add_argument("--peer", default=None, choices=["transformers"], help="also time HF transformers (subprocess)")
    b.add_argument("--kernels", choices=["on", "off", "only"], default="on",
                   help="the attention-kernel table (CUDA only; 'only' skips the end-to-end part)")
    b.add_argument("--kernel-contexts", default="32K,128K", help="cached tokens N of the kernel table")
    b.add_argument("--kernel-formats", default="bf16,int8,rk4v4-e8")
    b.add_argument("--chunk-tokens", type=parse_token_count,
                   default=4096, help="query chunk of the kernel table (default %(default)s)")


# -- FLOPs ----------------------------------------------------------------------------------------
def model_prefill_flops(mc: Any, n: int) -> float:
    """Matmul FLOPs of one prefill of n tokens of a dense decoder (projections, MLP, causal attention,
    one lm-head row)."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_tok = 2 * (h * q + 2 * h * kv + q * h + 3 * h * mc.intermediate_size)
    layers = mc.num_layers
    attn = len(mc.full_attention_layers) * 4.0 * mc.num_heads * mc.head_dim * n * (n + 1) / 2
    return float(layers * per_tok * n + attn + 2 * h * mc.vocab_size)


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 product on random data (median of 10 after 3 warm-ups)."""
    import statistics

    import torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3)
    return 2 * 8192 ** 3 / statistics.median(ts)


# -- end to end -----------------------------------------------------------------------------------
def prompts_for(vocab: int, n: int, repeats: int, seed: int) -> list[list[int]]:
    return [T.random_prompt(vocab, n, body_seed=seed + n, head_seed=r + 1) for r in range(repeats)]


def ninfer_e2e(cfg: Any, lengths: list[int], repeats: int, warmup: int) -> dict[str, Any]:
    engine = T.start_engine(cfg.replace(max_context=max(lengths) + 16))
    try:
        out: dict[str, Any] = {"engine": T.engine_facts(engine), "rows": []}
        vocab = engine.model_config.vocab_size
        T.timed_request(engine, "warmup", T.random_prompt(vocab, warmup, body_seed=cfg.seed + 7919, head_seed=0), 1)
        for n in lengths:
            ttfts = []
            for r, prompt in enumerate(prompts_for(vocab, n, repeats, cfg.seed)):
                ttfts.append(T.timed_request(engine, f"p{n}-{r}", prompt, 1)["ttft_s"])
                print(f"  {n}: TTFT {ttfts[-1]:.3f} s", file=sys.stderr)
            med = T.median(ttfts)
            out["rows"].append({"prompt_tokens": n, "ttft_s": ttfts, "ttft_median_s": med,
                                "prefill_tok_s": n / med, "collapsed_repeats": T.ttft_collapse(ttfts)})
        return out
    finally:
        del engine
        T.release()


_PEER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
a = json.loads(sys.argv[1])
dev = "cuda" if torch.cuda.is_available() else "cpu"
m = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
def sync():
    if dev == "cuda":
        torch.cuda.synchronize()
def one(ids):
    x = torch.tensor([ids], device=dev)
    sync(); t0 = time.perf_counter()
    with torch.no_grad():
        m(input_ids=x, logits_to_keep=1, use_cache=False)
    sync(); return time.perf_counter() - t0
one(a["warmup"])
for n, prompts in a["prompts"].items():
    try:
        print("PEER " + json.dumps({"n": int(n), "ttft_s": [one(p) for p in prompts]}), flush=True)
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        print("PEER " + json.dumps({"n": int(n), "error": "OutOfMemoryError: " + str(e)[:200]}), flush=True)
"""


def transformers_e2e(model_dir: str, vocab: int, lengths: list[int], repeats: int, seed: int,
                     warmup: int) -> dict[str, Any]:
    """The same prompts through HF transformers in a subprocess (its own CUDA context and memory)."""
    arg = {"model": model_dir, "warmup": T.random_prompt(vocab, warmup, body_seed=seed + 7919, head_seed=0),
           "prompts": {str(n): prompts_for(vocab, n, repeats, seed) for n in lengths}}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(arg, f)
    code = _PEER.replace('json.loads(sys.argv[1])', 'json.load(open(sys.argv[1]))')
    proc = subprocess.run([sys.executable, "-c", code, f.name], capture_output=True, text=True, env=dict(os.environ))
    os.unlink(f.name)
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("PEER "):
            r = json.loads(line[5:])
            if "ttft_s" in r:
                med = T.median(r["ttft_s"])
                r.update(ttft_median_s=med, prefill_tok_s=r["n"] / med)
            rows.append(r)
    out: dict[str, Any] = {"rows": rows, "rc": proc.returncode}
    if proc.returncode or not rows:
        out["error"] = proc.stderr[-2000:]
    return out


# -- kernels --------------------------------------------------------------------------------------
def _median_ms(fn, reps: int = 10) -> float:
    import statistics

    import torch
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def kernel_rows(contexts: list[int], formats: list[str], chunk: int, orders: dict[str, tuple] | None = None,
                triton_too: bool = True) -> list[dict[str, Any]]:
    """One row per (geometry, N, path): ms, TFLOP/s and the ratio to the fastest SDPA bf16 backend."""
    import torch

    from ninfer.attention import prefill_sdpa as PS
    from ninfer.bench.kernels import random_planes
    from ninfer.config import PAGE_SIZE
    from ninfer.kernels.prefill import paged_prefill_triton
    from ninfer.kvcache.formats import get_format
    orders = orders or {"": None}
    rows: list[dict[str, Any]] = []
    dev = torch.device("cuda")
    for gname, (hq, hkv, d) in GEOMETRIES.items():
        for n in contexts:
            g = torch.Generator(device=dev).manual_seed(n + d)
            q = torch.randn(chunk, hq, d, dtype=torch.bfloat16, device=dev, generator=g)
            qs = q.permute(1, 0, 2)[None]
            kv = torch.randn(2, 1, hq, n, d, dtype=torch.bfloat16, device=dev, generator=g)
            base = []
            for be in ("flash", "cudnn"):
                try:
                    ms = _median_ms(lambda: PS.sdpa_lse(qs, kv[0], kv[1], False, d ** -0.5, (be,)))
                    tf = 4.0 * hq * d * chunk * n / ms / 1e9
                    base.append(tf)
                    rows.append({"geometry": gname, "context": n, "path": f"sdpa-{be} bf16", "ms": ms, "tflops": tf})
                except RuntimeError as e:
                    rows.append({"geometry": gname, "context": n, "path": f"sdpa-{be} bf16", "error": str(e)[:200]})
            del kv
            best = max(base) if base else None
            seq = n + chunk
            pages = -(-seq // PAGE_SIZE)
            bt = torch.randperm(pages, device=dev, generator=g).to(torch.int32)[None]
            flops = 4.0 * hq * d * chunk * (n + chunk / 2)
            for f in formats:
                planes = random_planes(get_format(f), d, hkv, pages, dev, g)
                paths = [(f"ninfer-sdpa{('-' + k) if k else ''} {f}", o) for k, o in orders.items()]
                for label, order in paths + ([(f"ninfer-triton {f}", "triton")] if triton_too else []):
                    if order == "triton":
                        qsl = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
                        sl = torch.tensor([seq], dtype=torch.int32, device=dev)
                        fn = lambda: paged_prefill_triton(q, planes, planes, qsl, sl, bt, chunk, get_format(f),  # noqa: E731
                                                          d ** -0.5)
                    else:
                        fn = lambda: PS.prefill_sdpa(q, planes, f, [chunk], [seq], bt, d ** -0.5,  # noqa: E731
                                                     order=order)
                    try:
                        ms = _median_ms(fn, reps=5 if order == "triton" else 10)
                        tf = flops / ms / 1e9
                        rows.append({"geometry": gname, "context": n, "path": label, "ms": ms, "tflops": tf,
                                     "x_best_sdpa": tf / best if best else None})
                    except Exception as e:  # keep the other rows
                        rows.append({"geometry": gname, "context": n, "path": label,
                                     "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    print(f"  {gname} N={n} {label}: {rows[-1].get('tflops', 'ERR')}", file=sys.stderr)
                del planes
            torch.cuda.empty_cache()
    return rows


def kernel_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| geometry | N | path | ms | TFLOP/s | x fastest SDPA bf16 |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['geometry']} | {r['context']} | {r['path']} | | | error: {r['error'][:80]} |")
        else:
            x = r.get("x_best_sdpa")
            lines.append(f"| {r['geometry']} | {r['context']} | {r['path']} | {r['ms']:.2f} | {r['tflops']:.0f} | "
                         f"{'' if x is None else f'{x:.2f}'} |")
    return "\n".join(lines)


def e2e_table(results: dict[str, Any], flops: dict[int, float], rate: float | None) -> str:
    lines = ["| engine | prompt | TTFT s (median) | prefill tok/s | % of ideal |", "|---|---|---|---|---|"]
    for name, res in results.items():
        if "error" in res and not res.get("rows"):
            lines.append(f"| {name} | | | | failed: {str(res['error'])[-120:]} |")
        for r in res.get("rows", []):
            n = r.get("prompt_tokens", r.get("n"))
            if "ttft_median_s" not in r:
                lines.append(f"| {name} | {n} | | | failed: {r.get('error', '')[:100]} |")
                continue
            ideal = f"{100 * flops[n] / rate / r['ttft_median_s']:.0f}%" if rate else "n/a"
            lines.append(f"| {name} | {n} | {r['ttft_median_s']:.2f} | {r['prefill_tok_s']:,.0f} | {ideal} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch
    out: dict[str, Any] = {"bench": "prefill", "env": T.environment(args.device), "model": args.model}
    cuda = torch.cuda.is_available() and str(args.device) != "cpu"
    rate = matmul_rate() if cuda else None
    out["bf16_matmul_tflops"] = None if rate is None else rate / 1e12
    errors: list[str] = []
    if args.kernels != "off" and cuda:
        rows = kernel_rows(T.token_counts(args.kernel_contexts), [s for s in args.kernel_formats.split(",") if s],
                           int(args.chunk_tokens))
        out["kernels"] = {"chunk_tokens": int(args.chunk_tokens), "rows": rows}
        print(kernel_table(rows))
    if args.kernels != "only":
        from ninfer.engine.engine import default_model_dir
        from ninfer.model_config import ModelConfig
        lengths = sorted(set(T.token_counts(args.prompt_tokens)))
        model_dir = args.model or str(default_model_dir())
        mc = ModelConfig.load(model_dir)
        flops = {n: model_prefill_flops(mc, n) for n in lengths}
        warmup = min(int(args.warmup_tokens or min(lengths)), max(lengths))
        results: dict[str, Any] = {}
        for kv in T.kv_dtypes(args.kv_dtype):
            T.release()
            print(f"[prefill] ninfer {kv}", file=sys.stderr)
            try:
                results[f"ninfer {kv}"] = ninfer_e2e(T.base_config(args, kv_dtype=kv, enable_prefix_caching=False),
                                                     lengths, args.repeats, warmup)
            except Exception as e:  # keep the other kv-dtypes' numbers
                results[f"ninfer {kv}"] = {"error": f"{type(e).__name__}: {e}"}
                errors.append(f"{kv}: {type(e).__name__}: {e}")
        if args.peer == "transformers":
            T.release()
            print("[prefill] transformers", file=sys.stderr)
            results["transformers"] = transformers_e2e(model_dir, mc.vocab_size, lengths, args.repeats, args.seed,
                                                       warmup)
            if "error" in results["transformers"]:
                errors.append(f"transformers: {results['transformers']['error'][-300:]}")
        out.update(e2e=results, model_flops=flops, settings={
            "prompt_tokens": lengths, "repeats": args.repeats, "warmup_tokens": warmup, "prefix_reuse": False,
            "generated_tokens": 1,
            "max_num_batched_tokens": args.max_num_batched_tokens, "peer": args.peer})
        print(e2e_table(results, flops, rate))
    for e in errors:
        print(f"FAIL {e}", file=sys.stderr)
    out.update(ok=not errors, errors=errors)
    T.write_json(args.json, out)
    return 1 if errors else 0
