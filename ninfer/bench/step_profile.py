"""`python -m ninfer.bench.step_profile MODEL [--kv-dtype F] [--context 32K] [--steps 32] [--json F]`
(CUDA): where one decode step's time goes. Prefills one random prompt of --context tokens, then runs
--steps decode steps as the engine does (CUDA graphs unless --enforce-eager) under torch.profiler and
sums the GPU kernels by kind (linear, attention, KV store, norms, ...). Printed per step: kernel time
per kind, the sum, and the step's wall time, so the gap between the two (launches, host work,
sampling) is measured too."""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from ninfer.config import parse_token_count

# first match wins; names of our kernels, torch's and cuBLAS's (lower case)
KINDS = (
    ("attention", ("nd_decode", "paged_decode", "decode_reduce", "window_partial", "flash", "sdpa", "fmha")),
    ("kv store", ("store_kv", "store")),
    ("linear", ("gemv", "gemm", "nvjet", "splitkreduce", "cutlass", "xmma", "scaled_mm", "matmul", "_dot")),
    ("norm + rope", ("rmsnorm", "rms_norm", "qk_norm", "rope")),
    ("activation", ("silu",)),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "exponential")),
    ("elementwise / copy", ("elementwise", "copy", "fill", "cat", "index", "add", "mul")),
)


GAP_US = 20.0


def kind_of(name: str) -> str:
    n = name.lower()
    for kind, keys in KINDS:
        if any(k in n for k in keys):
            return kind
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--kv-dtype", default="rk4v4-e8")
    ap.add_argument("--context", type=parse_token_count, default=32768)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=12, help="also list the N costliest kernels")
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="also run the steps under cProfile and list the N functions with the most own time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from ninfer.engine.llm import LLM
    from ninfer.engine.sampling import SamplingParams
    ctx = args.context
    if not torch.cuda.is_available():
        raise SystemExit("step_profile needs a CUDA GPU")
    gen = 2 * args.steps + 16
    try:
        llm = LLM(args.model, kv_dtype=args.kv_dtype, max_context=ctx + gen, enforce_eager=args.enforce_eager,
                  max_num_seqs=1)
    except (ValueError, OSError) as e:   # unknown kv-dtype, a context that does not fit, a bad model path
        raise SystemExit(f"step_profile: {e}")
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    prompt = torch.randint(0, vocab, (ctx - gen,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.add_request("p", prompt, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    while not any(len(r.output_token_ids) for r in eng.scheduler.running):   # prefill (chunked)
        eng.step()
    for _ in range(4):   # warm decode steps
        eng.step()
    torch.cuda.synchronize()
    walls = []
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    # unprofiled wall time too: the profiler adds host overhead
    plain = []
    for _ in range(2):
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - t0)
    host = None
    if args.host:
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps // 2):
            eng.step()
        torch.cuda.synchronize()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.host)
        host = buf.getvalue()
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    by_name: dict[str, float] = defaultdict(float)
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            k = kind_of(e.name)
            by_kind[k] += e.device_time
            count[k] += 1
            by_name[e.name] += e.device_time
            spans.append((e.time_range.start, e.time_range.end))
    # idle GPU time between kernels: short gaps are launch latency inside a graph, long ones the host
    spans.sort()
    short_gap = long_gap = 0.0
    for (_, end), (start, _) in zip(spans, spans[1:]):
        gap = max(0.0, start - end)
        if gap < GAP_US:
            short_gap += gap
        else:
            long_gap += gap
    n = args.steps
    kern = sum(by_kind.values()) / n
    walls.sort()
    wall_us = walls[len(walls) // 2] * 1e6
    plain_us = min(plain) * 1e6
    rows = sorted(((k, v / n, count[k] / n) for k, v in by_kind.items()), key=lambda r: -r[1])
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]
    if host:
        print(host[host.find("ncalls"):])
    print(f"{args.model}  kv {args.kv_dtype}  context {ctx}  graphs {not args.enforce_eager}  ({n} steps)")
    for name, us in top:
        print(f"  {us / n:8.1f} us  {name[:110]}")
    print(f"{'kind':<20} {'us/step':>9} {'kernels/step':>13} {'share':>7}")
    for k, us, c in rows:
        print(f"{k:<20} {us:9.1f} {c:13.1f} {us / kern:7.1%}")
    print(f"{'kernels, sum':<20} {kern:9.1f}")
    print(f"{'gaps < %g us' % GAP_US:<20} {short_gap / n:9.1f}   (between kernels: launch latency)")
    print(f"{'gaps >= %g us' % GAP_US:<20} {long_gap / n:9.1f}   (the GPU waits for the host)")
    print(f"{'step wall, profiled':<20} {wall_us:9.1f}   unprofiled {plain_us:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "kv_dtype": args.kv_dtype, "context": ctx, "steps": n,
                       "cuda_graphs": not args.enforce_eager, "device": torch.cuda.get_device_name(),
                       "kinds_us_per_step": {k: us for k, us, _ in rows},
                       "kernels_per_step": {k: c for k, _, c in rows}, "kernel_sum_us": kern,
                       "short_gaps_us_per_step": short_gap / n, "long_gaps_us_per_step": long_gap / n,
                       "step_wall_profiled_us": wall_us, "step_wall_unprofiled_us": plain_us,
                       "top_kernels_us_per_step": {nm: us / n for nm, us in top}}, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
