"""Shared pieces of the engine-level benchmarks (matched, sweep, memory): argument parsing,
engine lifetime, one timed request through the engine's own step loop, the cache-artifact
detector, and the JSON envelope (date, device, command) every result file carries."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ninfer.config import EngineConfig, add_engine_args, engine_config_from_args, parse_token_count

COLLAPSE_FACTOR = 0.5  # a repeat whose TTFT is below this fraction of the first one was served from a cache


# -- arguments ------------------------------------------------------------------------------------
def add_common_arguments(p: argparse.ArgumentParser, kv_default: str) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: the bundled probe model)")
    add_engine_args(p, model_positional=False)
    # the engine's --kv-dtype takes one name; here it is a comma-separated list, one engine each
    p.set_defaults(kv_dtype=kv_default)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON to PATH ('-' = stdout)")


def kv_dtypes(text: str) -> list[str]:
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    if not names:
        raise SystemExit("--kv-dtype: give at least one KV format")
    from ninfer.kvcache.formats import get_format
    for n in names:
        get_format(n)  # unknown or refused names fail before any engine starts
    return names


def token_counts(text: str) -> list[int]:
    return [parse_token_count(s.strip()) for s in str(text).split(",") if s.strip()]


def base_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The engine config of the command line with the benchmark's fixed knobs applied."""
    return engine_config_from_args(args).replace(**overrides)


# -- engine lifetime ------------------------------------------------------------------------------
def start_engine(cfg: EngineConfig) -> Any:
    from ninfer.engine.engine import LLMEngine
    engine = LLMEngine(cfg, progress=False)
    for line in engine.startup_lines:
        print(f"  {line}", file=sys.stderr)
    return engine


def release() -> None:
    """Return the device memory of engines the caller has already dropped (`del engine` first), so
    the next engine plans against the same free memory as the first."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_graphs_active(engine: Any) -> bool:
    runner = engine.runner
    return runner.forward_fn != runner.eager_forward


def engine_facts(engine: Any) -> dict[str, Any]:
    return {"device": str(engine.device), "tensor_parallel_size": engine.tp_size, "max_context": engine.max_context,
            "kv_capacity_tokens": engine.kv_capacity_tokens, "cuda_graphs": cuda_graphs_active(engine),
            "startup_lines": list(engine.startup_lines)}


def sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- prompts and one timed request ----------------------------------------------------------------
def random_prompt(vocab: int, n: int, *, body_seed: int, head_seed: int, head_tokens: int = 64) -> list[int]:
    """n random token ids: a body fixed by body_seed whose first head_tokens ids come from
    head_seed. Varying head_seed varies the first KV page, so no page of the prompt can be found
    in a prefix cache (page hashes chain from the first page)."""
    ids = torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(body_seed))
    k = min(head_tokens, n)
    ids[:k] = torch.randint(vocab, (k,), generator=torch.Generator().manual_seed(head_seed * 1_000_003 + 17))
    ids = ids.tolist()
    return ids


def timed_request(engine: Any, request_id: str, prompt_ids: list[int], gen_tokens: int) -> dict[str, Any]:
    """One greedy, EOS-ignoring request run alone through engine.step(). TTFT ends at the step
    that samples the first token (the whole chunked prefill); decode is the rest."""
    from ninfer.engine.sampling import SamplingParams
    if engine.has_unfinished_requests():
        raise RuntimeError("timed_request needs an idle engine")
    params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    dev = engine.device
    sync(dev)
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt_ids, params)
    t_first = None
    final = None
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.request_id != request_id:
                continue
            if t_first is None and out.new_token_ids:
                sync(dev)
                t_first = time.perf_counter()
            if out.finished:
                final = out
    sync(dev)
    t_end = time.perf_counter()
    if final is None or final.finish_reason != "length" or t_first is None:
        why = getattr(final, "error", None) or getattr(final, "finish_reason", None)
        raise RuntimeError(f"request {request_id} did not run to its length: {why}")
    n_gen = len(final.token_ids)
    ttft = t_first - t0
    decode_s = t_end - t_first
    return {"prompt_tokens": len(prompt_ids), "generated_tokens": n_gen, "cached_tokens": final.num_cached_tokens,
            "steps": steps, "ttft_s": ttft, "prefill_tok_s": len(prompt_ids) / ttft, "decode_s": decode_s,
            "decode_tok_s": (n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else None,
            "wall_s": t_end - t0}


# -- statistics -----------------------------------------------------------------------------------
def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ttft_collapse(ttfts: list[float], factor: float = COLLAPSE_FACTOR) -> list[int]:
    """Indices of repeats (after the first) whose TTFT fell below factor x the first repeat's:
    with prefix reuse off and the prompt head varied, only a cache can make prefill that fast."""
    if len(ttfts) < 2 or factor <= 0:
        return []
    return [i for i, t in enumerate(ttfts[1:], start=1) if t < factor * ttfts[0]]


def pct(a: float | int | None, b: float | int | None) -> float | None:
    """Percent difference of a from the reference b."""
    if a is None or b is None or b == 0:
        return None
    return 100.0 * (a - b) / b


def fmt(x: Any, spec: str = ",.0f", na: str = "n/a") -> str:
    return na if x is None else format(x, spec)


# -- result files ---------------------------------------------------------------------------------
def environment(device: Any = None) -> dict[str, Any]:
    env: dict[str, Any] = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                           "command": " ".join(["ninfer", *sys.argv[1:]]) if sys.argv else "",
                           "torch": torch.__version__, "python": platform.python_version(),
                           "host": platform.node()}
    dev = torch.device(device) if device is not None and str(device) != "auto" else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(dev if dev is not None else 0)
    else:
        env["gpu"] = None
    return env


def write_json(path: str | None, obj: dict[str, Any]) -> None:
    if not path:
        return
    text = json.dumps(obj, indent=2, default=str)
    if path == "-":
        print(text)
    else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)


# -- planning without an engine -------------------------------------------------------------------
def plan_only(cfg: EngineConfig, max_context: int) -> Any:
    """The MemoryPlan LLMEngine would make at startup for cfg with this max_context, made the same way
    (same rope overrides, dtype resolution and device memory) but allocating nothing. Raises
    planner.ContextDoesNotFit when that start would be refused."""
    from ninfer.engine.engine import default_model_dir
    from ninfer.kvcache.planner import device_memory, plan_for_engine
    from ninfer.model_config import ModelConfig
    from ninfer.models.loader import resolve_device, resolve_dtype
    from ninfer.layers.rotary import apply_rope_overrides
    mc = apply_rope_overrides(ModelConfig.load(cfg.model or default_model_dir()), cfg.rope_yarn_factor,
                              cfg.rope_original_max_position)
    dev = resolve_device(cfg.device)
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[resolve_dtype(cfg.dtype, mc)]
    mem = device_memory(dev, cfg.memory_limit_gib)
    return plan_for_engine(mc, cfg.replace(dtype=dname), mem, dev.type, max_context=max_context)


def planner_largest_context(cfg: EngineConfig) -> int:
    """The planner's closed-form largest context for cfg's kv-dtype on this device (0 = none fits)."""
    from ninfer.kvcache.planner import ContextDoesNotFit
    try:
        return int(plan_only(cfg, 64).largest_context)
    except ContextDoesNotFit as e:
        return int(e.largest_context)
