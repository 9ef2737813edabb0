"""Context sweep: prefill tok/s, wall time and decode tok/s per kv-dtype from 32K up to the largest
context that fits (ninfer.kvcache.planner), under --memory-limit or on the whole card.

A context C is one request of C - gen prompt tokens (random ids) plus --gen-tokens generated, greedy,
EOS ignored, prefix reuse off, timed through LLMEngine.step() as in `ninfer bench matched`.
"auto" contexts double from --auto-start while they fit, then the largest context that fits is
added. Contexts that do not fit are skipped with the planner's refusal as the recorded reason.
One engine per kv-dtype, started at the largest context that fits among those asked (every
smaller one runs in the same engine); --time-budget skips contexts whose predicted time (the last
one's, scaled quadratically) would overrun it. A PNG plots prefill and decode tok/s vs context.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ninfer.bench import _timing as T
from ninfer.config import PAGE_SIZE, parse_token_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    T.add_common_arguments(p, kv_default="int8,rk4v4-e8")
    b = p.add_argument_group("benchmark")
    b.add_argument("--contexts", default="auto", help="comma-separated contexts (e.g. 32K,64K,128K) or auto")
    b.add_argument("--auto-start", type=parse_token_count, default=32768, help="first auto context (default 32K)")
    b.add_argument("--auto-cap", type=parse_token_count, default=None,
                   help="auto: stop doubling at this context (the largest that fits is still capped by it)")
    b.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per context (default %(default)s)")
    b.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="seconds per kv-dtype; skip contexts predicted to overrun it")
    b.add_argument("--plot", default=None, metavar="PNG", help="write a plot of tok/s vs context")
    b.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="run nothing: draw --plot from these sweep JSON files (one run or one per kv-dtype)")


def contexts_for(args: argparse.Namespace, largest: int) -> list[int]:
    """The contexts to try for a kv-dtype whose planner largest context is `largest`."""
    if str(args.contexts).strip().lower() != "auto":
        return sorted(set(T.token_counts(args.contexts)))
    top = largest if args.auto_cap is None else min(largest, args.auto_cap)
    top -= top % PAGE_SIZE
    out, c = [], args.auto_start
    while c <= top:
        out.append(c)
        c *= 2
    if top >= args.auto_start and top not in out:
        out.append(top)
    return out


def sweep_kv(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from ninfer.kvcache.planner import ContextDoesNotFit
    largest = T.planner_largest_context(cfg)
    rows: list[dict[str, Any]] = []
    fit: list[int] = []
    for c in contexts_for(args, largest):
        if c <= args.gen_tokens:
            rows.append({"context": c, "skipped": f"context {c} <= --gen-tokens {args.gen_tokens}"})
            continue
        try:
            T.plan_only(cfg, c)
            fit.append(c)
        except ContextDoesNotFit as e:
            rows.append({"context": c, "skipped": str(e)})
    out: dict[str, Any] = {"planner_largest_context": largest, "rows": rows}
    if not fit:
        return out
    engine = T.start_engine(cfg.replace(max_context=max(fit)))
    try:
        out["engine"] = T.engine_facts(engine)
        vocab = engine.model_config.vocab_size
        # warm-up at the first context's length: its first-use costs must not land in that point
        T.timed_request(engine, "warmup", T.random_prompt(vocab, fit[0] - args.gen_tokens, body_seed=cfg.seed + 7919,
                                                          head_seed=1), max(1, min(4, args.gen_tokens)))
        t0 = time.perf_counter()
        last: tuple[int, float] | None = None
        for i, c in enumerate(fit):
            if args.time_budget is not None and last is not None:
                predicted = last[1] * (c / last[0]) ** 2
                spent = time.perf_counter() - t0
                if spent + predicted > args.time_budget:
                    rows.append({"context": c, "skipped": f"time budget: {spent:.0f} s spent, ~{predicted:.0f} s "
                                                          f"predicted, --time-budget {args.time_budget:.0f} s"})
                    continue
            prompt = T.random_prompt(vocab, c - args.gen_tokens, body_seed=cfg.seed + c, head_seed=i)
            try:
                r = T.timed_request(engine, f"ctx{c}", prompt, args.gen_tokens)
            except Exception as e:  # keep the points measured so far; the engine may be unusable now
                rows.append({"context": c, "error": f"{type(e).__name__}: {e}"})
                break
            rows.append({"context": c, **r})
            last = (c, r["wall_s"])
            print(f"  {c:>9}: TTFT {r['ttft_s']:.2f} s  prefill {T.fmt(r['prefill_tok_s'])} tok/s  "
                  f"decode {T.fmt(r['decode_tok_s'], ',.1f')} tok/s  wall {r['wall_s']:.2f} s", file=sys.stderr)
    finally:
        del engine
        T.release()
    rows.sort(key=lambda r: r["context"])
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| kv-dtype | context | TTFT s | prefill tok/s | decode tok/s | wall s | note |",
             "|---|---|---|---|---|---|---|"]
    for kv, res in results.items():
        if "error" in res:
            lines.append(f"| {kv} | | | | | | failed: {res['error']} |")
        for r in res.get("rows", []):
            if "error" in r:
                lines.append(f"| {kv} | {r['context']} | | | | | FAILED: {r['error'][:120]} |")
            elif "skipped" in r:
                lines.append(f"| {kv} | {r['context']} | | | | | skipped: {r['skipped'][:120]} |")
            else:
                lines.append(f"| {kv} | {r['context']} | {r['ttft_s']:.2f} | {T.fmt(r['prefill_tok_s'])} | "
                             f"{T.fmt(r['decode_tok_s'], ',.1f')} | {r['wall_s']:.2f} | |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for kv, res in results.items():
        rows = [r for r in res.get("rows", []) if "prefill_tok_s" in r]
        if not rows:
            continue
        x = [r["context"] for r in rows]
        axes[0].plot(x, [r["prefill_tok_s"] for r in rows], marker="o", label=kv)
        axes[1].plot(x, [r["decode_tok_s"] for r in rows], marker="o", label=kv)
    for ax, what in zip(axes, ("prefill tok/s", "decode tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def plot_from_json(paths: list[str], png: str) -> dict[str, dict[str, Any]]:
    """Redraw the plot of earlier runs: their kv-dtypes merged in order, titled from the first run."""
    import json
    results: dict[str, dict[str, Any]] = {}
    runs = []
    for path in paths:
        try:
            run_ = json.loads(Path(path).read_text())
            results.update(run_["results"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--from-json {path}: not a sweep JSON ({type(e).__name__}: {e})")
        runs.append(run_)
    first, env = runs[0], runs[0].get("env", {})
    limit = first.get("settings", {}).get("memory_limit_gib")
    name = Path(first.get("model") or "probe").name
    plot(results, png, f"{name}, {f'--memory-limit {limit:g} GiB' if limit else 'whole device'}, "
                       f"gen {first.get('settings', {}).get('gen_tokens')}, {env.get('gpu') or 'cpu'}, "
                       f"{str(env.get('date_utc', ''))[:10]}")
    return results


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from-json needs --plot PNG")
        plot_from_json(args.from_json, args.plot)
        return 0
    kvs = T.kv_dtypes(args.kv_dtype)
    results: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for kv in kvs:
        T.release()
        cfg = T.base_config(args, kv_dtype=kv, enable_prefix_caching=False)
        print(f"[sweep] {kv}", file=sys.stderr)
        try:
            results[kv] = sweep_kv(cfg, args)
            errors += [f"{kv} context {r['context']}: {r['error']}" for r in results[kv]["rows"] if "error" in r]
        except Exception as e:  # keep the other kv-dtypes' numbers
            results[kv] = {"error": f"{type(e).__name__}: {e}"}
            errors.append(f"{kv}: {type(e).__name__}: {e}")
    print(table(results))
    limit = f"--memory-limit {args.memory_limit_gib:g} GiB" if args.memory_limit_gib else "whole device"
    env = T.environment(args.device)
    if args.plot:
        name = Path(args.model).name if args.model else "probe"
        plot(results, args.plot, f"{name}, {limit}, gen {args.gen_tokens}, {env.get('gpu') or 'cpu'}")
    for e in errors:
        print(f"FAIL {e}", file=sys.stderr)
    T.write_json(args.json, {
        "bench": "sweep", "env": env, "model": args.model,
        "settings": {"contexts": args.contexts, "auto_start": args.auto_start, "auto_cap": args.auto_cap,
                     "gen_tokens": args.gen_tokens, "memory_limit_gib": args.memory_limit_gib,
                     "enforce_eager": args.enforce_eager, "time_budget": args.time_budget, "prefix_reuse": False,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs},
        "results": results, "ok": not errors, "errors": errors})
    return 1 if errors else 0
