"""Memory: planned vs engine-reported vs device-peak bytes, and the capacity frontier (DESIGN §3).

(a) Agreement, per kv-dtype: start an engine, run one request whose prompt is exactly the largest
prefill chunk (--max-num-batched-tokens) followed by decode steps, then set side by side
  planned   the MemoryPlan terms (weights + runtime = kv + states + page tables + workspace + graphs)
  engine    what it holds: weights (its parameters), KV pool (bytes_allocated), recurrent states,
            graph pool (observed)
  device    torch.cuda max_memory_allocated / max_memory_reserved, the device's used memory
            (cudaMemGetInfo) and nvidia-smi's memory.used, each as growth over the moment before
            the engine started, after a small engine has started, served and gone (so the CUDA
            context and what loads once per process, reported as process_first_use, are not counted)
with percent differences. On CUDA a device figure further than --tolerance % from the planned
total fails the run (torch's peak allocated only when above it: the workspace and graph terms are
upper bounds); on CPU the device columns are n/a and only the engine terms are compared.

(b) --frontier: with the planner alone (no allocation) find, on page granularity, the largest
--max-context that starts and the smallest refused; then prove both with real engines (the refused
one must raise ContextDoesNotFit) and start --starts engines in a row at the frontier (CUDA graphs
on unless --no-cuda-graph), each serving a short request. All must succeed. Before the search one
engine is started and used once (or (a) ran), so kernels, the CUDA context and library
workspaces are in place, and after the first search one unmeasured engine starts at the frontier
(it loads the kernel variants of that size) before the search is repeated: the frontier is
measured in the state every later start sees.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from typing import Any

import torch

from ninfer.bench import _timing as T
from ninfer.config import PAGE_SIZE
from ninfer.kvcache.workspace import AUTO_PREFILL_CHUNKS


def add_arguments(p: argparse.ArgumentParser) -> None:
    T.add_common_arguments(p, kv_default="int8,rk4v4-e8")
    b = p.add_argument_group("benchmark")
    b.add_argument("--gen-tokens", type=int, default=8, help="decode steps after the prefill (default %(default)s)")
    b.add_argument("--tolerance", type=float, default=1.0, help="percent allowed between plan and device (default 1)")
    b.add_argument("--no-agreement", dest="agreement", action="store_false", help="skip part (a)")
    b.add_argument("--frontier", action="store_true", help="find and verify the capacity frontier (part b)")
    b.add_argument("--starts", type=int, default=20, help="consecutive starts at the frontier (default %(default)s)")


# -- device measurements --------------------------------------------------------------------------
def nvidia_smi_used(device: torch.device) -> int | None:
    """memory.used of this GPU in bytes from nvidia-smi (None when unavailable or ambiguous)."""
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
    props = torch.cuda.get_device_properties(device)
    want = tuple(getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    try:
        for bus, used in rows:
            dom, b, dev_fn = bus.strip().split(":")
            if want == (int(dom, 16), int(b, 16), int(dev_fn.split(".")[0], 16)):
                return int(used) * (1 << 20)
        return int(rows[0][1]) * (1 << 20) if len(rows) == 1 else None
    except ValueError:  # an unexpected format ("[N/A]", another bus-id layout): no reading rather than a wrong one
        return None


def device_snapshot(device: torch.device) -> dict[str, int | None]:
    if device.type != "cuda":
        return {"torch_allocated": None, "torch_reserved": None, "device_used": None, "nvidia_smi_used": None}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"torch_allocated": torch.cuda.memory_allocated(device), "torch_reserved": torch.cuda.memory_reserved(device),
            "device_used": total - free, "nvidia_smi_used": nvidia_smi_used(device)}


def weights_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:  # a tied lm_head is the embedding
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


# -- (a) agreement --------------------------------------------------------------------------------
def settle(cfg: Any) -> None:
    """Start a small engine and serve once: CUDA kernels, library handles and workspaces load on
    first use, once per process, whatever the plan; measured starts come after this."""
    T.release()
    chunk = AUTO_PREFILL_CHUNKS[-1] if cfg.max_num_batched_tokens == "auto" else cfg.max_num_batched_tokens
    small = min(chunk + PAGE_SIZE, T.planner_largest_context(cfg))
    if small > PAGE_SIZE:
        engine = T.start_engine(cfg.replace(max_context=small))
        _serve_once(engine, cfg.seed)
        del engine
    T.release()


def agreement(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    T.release()
    first_use = None
    if dev.type == "cuda":
        torch.cuda.init()
        fresh = device_snapshot(dev)
        settle(cfg)
        settled = device_snapshot(dev)
        # what stays after the settling engine is gone: one-time per process, inside the headroom
        first_use = {k: (None if settled[k] is None or fresh[k] is None else settled[k] - fresh[k])
                     for k in ("torch_reserved", "device_used")}
        torch.cuda.reset_peak_memory_stats(dev)
    before = device_snapshot(dev)
    engine = T.start_engine(cfg)
    try:
        plan = engine.plan
        held = {"weights": weights_bytes(engine.model), "kv": engine.pool.bytes_allocated,
                "states": engine.pool.state_bytes_allocated,
                "graphs": plan.graph_bytes_observed if T.cuda_graphs_active(engine) else None}
        after_start = device_snapshot(dev)
        prompt_n = min(plan.max_num_batched_tokens, engine.max_context - args.gen_tokens)
        req = T.timed_request(engine, "memory", T.random_prompt(engine.model_config.vocab_size, prompt_n,
                                                                body_seed=cfg.seed, head_seed=0), args.gen_tokens)
        after_run = device_snapshot(dev)
        _serve_once(engine, cfg.seed)  # the frontier's probe request: its kernels are loaded from here on
        facts = T.engine_facts(engine)
        peak_alloc = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        peak_reserved = torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None
    finally:
        del engine
        T.release()

    def grown(now: int | None, base: int | None) -> int | None:
        return None if now is None or base is None else now - base

    planned_total = plan.weights_bytes + plan.runtime_bytes
    device = {
        "torch_peak_allocated": grown(peak_alloc, before["torch_allocated"]),
        "torch_peak_reserved": grown(peak_reserved, before["torch_reserved"]),
        "device_used": grown(max(filter(None, (after_start["device_used"], after_run["device_used"])), default=None),
                             before["device_used"]),
        "nvidia_smi_used": grown(max(filter(None, (after_start["nvidia_smi_used"], after_run["nvidia_smi_used"])),
                                     default=None), before["nvidia_smi_used"]),
    }
    terms = {"weights": (plan.weights_bytes, held["weights"]), "kv": (plan.kv_bytes, held["kv"]),
             "graphs": (plan.graph_bytes, held["graphs"])}
    if plan.state_bytes:  # recurrent layers' state slots (exact arithmetic, like KV)
        terms["states"] = (plan.state_bytes, held["states"])
    failures = []
    for name, (planned, got) in terms.items():
        d = T.pct(got, planned)
        # weights, KV and states are exact arithmetic; the graph pool is an allowance, judged inside the totals
        if name != "graphs" and d is not None and abs(d) > args.tolerance:
            failures.append(f"{name}: engine {got} B vs planned {planned} B ({d:+.2f}%)")
    for name, got in device.items():
        d = T.pct(got, planned_total)
        # torch's live tensors may sit below the plan (the workspace and graph terms are upper
        # bounds) but never above it; what the device holds (reserved, cudaMemGetInfo,
        # nvidia-smi) must agree both ways
        if d is not None and (d > args.tolerance if name == "torch_peak_allocated" else abs(d) > args.tolerance):
            failures.append(f"{name}: device {got} B vs planned total {planned_total} B ({d:+.2f}%)")
    return {"engine": facts, "plan": plan.as_dict(), "planned_total": planned_total,
            "terms": {k: {"planned": a, "engine": b, "pct": T.pct(b, a)} for k, (a, b) in terms.items()},
            "device": {k: {"bytes": v, "pct_vs_planned_total": T.pct(v, planned_total)} for k, v in device.items()},
            "snapshots": {"before": before, "after_start": after_start, "after_request": after_run},
            "process_first_use": first_use,
            "request": {"prompt_tokens": prompt_n, "generated": req["generated_tokens"]},
            "failures": failures}


# -- (b) frontier ---------------------------------------------------------------------------------
def frontier_search(cfg: Any) -> dict[str, Any]:
    """Largest max_context (multiple of PAGE_SIZE) the planner accepts, by doubling then bisection."""
    from ninfer.kvcache.planner import ContextDoesNotFit

    def fits(ctx: int) -> bool:
        try:
            T.plan_only(cfg, ctx)
            return True
        except ContextDoesNotFit:
            return False

    calls = 1
    if not fits(PAGE_SIZE):
        return {"largest_ok": 0, "smallest_refused": PAGE_SIZE, "planner_calls": calls,
                "planner_largest_context": T.planner_largest_context(cfg)}
    lo, hi = 1, 2  # in pages: lo fits, hi unknown
    while fits(hi * PAGE_SIZE):
        lo, hi = hi, hi * 2
        calls += 1
    calls += 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        calls += 1
        if fits(mid * PAGE_SIZE):
            lo = mid
        else:
            hi = mid
    return {"largest_ok": lo * PAGE_SIZE, "smallest_refused": hi * PAGE_SIZE, "planner_calls": calls,
            "planner_largest_context": T.planner_largest_context(cfg)}


def _serve_once(engine: Any, seed: int) -> None:
    n = min(PAGE_SIZE, engine.max_context - 2)
    T.timed_request(engine, "probe", T.random_prompt(engine.model_config.vocab_size, n, body_seed=seed, head_seed=0), 2)


def frontier(cfg: Any, args: argparse.Namespace, settled: bool) -> dict[str, Any]:
    from ninfer.kvcache.planner import ContextDoesNotFit
    from ninfer.models.loader import resolve_device
    want_graphs = not cfg.enforce_eager and resolve_device(cfg.device).type == "cuda"
    if not settled:  # load kernels, context and workspaces once, so every measured start sees the same device
        settle(cfg)
    res = frontier_search(cfg)
    if res["largest_ok"]:
        # An engine at the frontier loads kernel variants a small one does not (its page-table width, its
        # workspace shapes), and loaded modules keep their device memory: start one there once, unmeasured,
        # then search again, so the frontier holds for every later start in this process too.
        first, err = res["largest_ok"], None
        try:
            engine = T.start_engine(cfg.replace(max_context=first))
            _serve_once(engine, cfg.seed)
            del engine
        except Exception as e:  # the search below decides; a failure here is reported beside it
            err = f"{type(e).__name__}: {e}"
        T.release()
        res = frontier_search(cfg)
        res["first_search_largest_ok"] = first
        if err:
            res["settle_at_frontier_error"] = err
    res["free_bytes_at_search"] = T.plan_only(cfg, res["largest_ok"]).free_bytes if res["largest_ok"] else None
    failures: list[str] = [] if res["largest_ok"] else ["no context fits at all"]
    ok, refused = res["largest_ok"], res["smallest_refused"]
    if ok and ok != res["planner_largest_context"]:
        failures.append(f"bisection found {ok} but the planner's closed form says {res['planner_largest_context']}")
    # the refused side first: it allocates nothing, and must not start
    try:
        engine = T.start_engine(cfg.replace(max_context=refused))
        failures.append(f"max_context={refused} started, but the planner refuses it")
        del engine
        res["refusal"] = None
    except ContextDoesNotFit as e:
        res["refusal"] = str(e)
    T.release()
    starts = []
    for i in range(args.starts if ok else 0):
        rec: dict[str, Any] = {"start": i}
        engine = None
        try:
            engine = T.start_engine(cfg.replace(max_context=ok))
            rec.update(free_bytes=engine.plan.free_bytes, pages=engine.plan.num_pages,
                       cuda_graphs=T.cuda_graphs_active(engine))
            _serve_once(engine, cfg.seed + i)
            if want_graphs and not rec["cuda_graphs"]:
                rec["error"] = "CUDA graphs requested but not active"
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        engine = None
        T.release()
        if "error" in rec:
            failures.append(f"start {i} at max_context={ok}: {rec['error']}")
        starts.append(rec)
        print(f"  start {i}: {'ok' if 'error' not in rec else rec['error']}", file=sys.stderr)
    frees = {s.get("free_bytes") for s in starts if s.get("free_bytes") is not None}
    res.update(starts=starts, starts_ok=sum("error" not in s for s in starts), starts_asked=args.starts,
               free_bytes_drift=(max(frees) - min(frees)) if frees else None, failures=failures)
    return res


# -- output ---------------------------------------------------------------------------------------
def _size(n: int | None) -> str:
    from ninfer.kvcache.planner import format_bytes
    return "n/a" if n is None else format_bytes(n)


def agreement_table(kv: str, a: dict[str, Any]) -> str:
    lines = [f"{kv}: planned total (weights + runtime) {_size(a['planned_total'])}",
             "| term | planned | engine | diff % |", "|---|---|---|---|"]
    for name, t in a["terms"].items():
        lines.append(f"| {name} | {_size(t['planned'])} | {_size(t['engine'])} | {T.fmt(t['pct'], '+.3f')} |")
    lines += ["| device (growth over pre-start) | bytes | vs planned total % | |", "|---|---|---|---|"]
    for name, d in a["device"].items():
        lines.append(f"| {name} | {_size(d['bytes'])} | {T.fmt(d['pct_vs_planned_total'], '+.3f')} | |")
    return "\n".join(lines)


def frontier_line(kv: str, f: dict[str, Any]) -> str:
    return (f"{kv}: largest context that starts {f['largest_ok']}, smallest refused {f['smallest_refused']} "
            f"(planner closed form {f['planner_largest_context']}, {f['planner_calls']} planner calls); "
            f"starts at the frontier {f['starts_ok']}/{f['starts_asked']} ok; "
            f"refused start raised ContextDoesNotFit: {'yes' if f.get('refusal') else 'NO'}")


def run(args: argparse.Namespace) -> int:
    kvs = T.kv_dtypes(args.kv_dtype)
    if not args.agreement and not args.frontier:
        raise SystemExit("nothing to do: --no-agreement without --frontier")
    results: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for kv in kvs:
        T.release()
        cfg = T.base_config(args, kv_dtype=kv, enable_prefix_caching=False,
                            max_context=args.max_context or 32768)
        res: dict[str, Any] = {}
        results[kv] = res
        print(f"[memory] {kv}", file=sys.stderr)
        if args.agreement:
            try:
                res["agreement"] = agreement(cfg, args)
                print(agreement_table(kv, res["agreement"]))
                errors += [f"{kv} agreement: {m}" for m in res["agreement"]["failures"]]
            except Exception as e:
                res["agreement"] = {"error": f"{type(e).__name__}: {e}"}
                errors.append(f"{kv} agreement: {type(e).__name__}: {e}")
        if args.frontier:
            T.release()
            try:
                res["frontier"] = frontier(cfg, args, settled="engine" in res.get("agreement", {}))
                print(frontier_line(kv, res["frontier"]))
                errors += [f"{kv} frontier: {m}" for m in res["frontier"]["failures"]]
            except Exception as e:
                res["frontier"] = {"error": f"{type(e).__name__}: {e}"}
                errors.append(f"{kv} frontier: {type(e).__name__}: {e}")
    for e in errors:
        print(f"FAIL {e}", file=sys.stderr)
    T.write_json(args.json, {
        "bench": "memory", "env": T.environment(args.device), "model": args.model,
        "settings": {"memory_limit_gib": args.memory_limit_gib, "max_context": args.max_context or 32768,
                     "kv_capacity": args.kv_capacity, "enforce_eager": args.enforce_eager,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                     "gen_tokens": args.gen_tokens, "tolerance_pct": args.tolerance, "starts": args.starts},
        "results": results, "ok": not errors, "errors": errors})
    return 1 if errors else 0
