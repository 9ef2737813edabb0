"""`ninfer plan`: KV capacity per kv-dtype from a config.json alone (no weights, no GPU).

Public API: `add_arguments(parser)`, `run(args) -> int`, `plan_table(model, args) -> list[dict]`.

For each kv-dtype (every servable format except `auto`, which is the weights dtype's own format,
unless --kv-dtype names some) it prints bytes per token, the largest context that fits on a device
of --memory GiB (default 80 GiB, an 80 GB-class card; an H200 reports ~140 GiB), and the startup
capacity line the engine would print. The device is planned as empty CUDA memory of that size
(the real card's CUDA context takes a few hundred MiB more). With --tensor-parallel-size N every
number is one rank's (its weight shard, its KV heads, its recurrent states); the capacity lines
add the group's totals.
Exit status: 0 when --max-context fits with every listed kv-dtype, 1 when any refuses (its numbers
are printed), 2 for bad input (missing or unreadable config, unknown kv-dtype).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ninfer.config import parse_token_count

DEFAULT_MEMORY_GIB = 80.0


def _capacity(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else parse_token_count(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="HF model directory, its config.json, a .gguf file, or alias smollm2")
    p.add_argument("--memory", "--memory-limit", dest="memory", type=float, default=DEFAULT_MEMORY_GIB,
                   metavar="GiB", help="device memory to plan for (default %(default)g GiB)")
    p.add_argument("--max-context", "--max-model-len", dest="max_context", type=parse_token_count, default=None,
                   help="context to check (default: the model's window, rope scaling included)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", action="append", default=None,
                   help="kv-dtype(s) to plan (repeat or comma-separate; default: all servable formats)")
    p.add_argument("--kv-capacity", dest="kv_capacity", type=_capacity, default="auto",
                   help="KV pool size in tokens, or auto (default)")
    p.add_argument("--weights-dtype", "--dtype", dest="weights_dtype", default="auto",
                   choices=["auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"],
                   help="weights/activation dtype (default: the config's torch_dtype)")
    p.add_argument("--max-concurrency", "--max-num-seqs", dest="max_num_seqs", type=int, default=64,
                   help="most requests running at once (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", "--prefill-chunk", dest="max_num_batched_tokens",
                   type=_capacity, default="auto", help="token budget per step, or auto (default)")
    p.add_argument("--no-cuda-graph", "--enforce-eager", dest="enforce_eager", action="store_true",
                   help="plan without decode CUDA graphs")
    p.add_argument("--rope-yarn-factor", dest="rope_yarn_factor", type=float, default=None,
                   help="plan for YaRN-extended context (the default max-context follows it)")
    p.add_argument("--rope-original-max-position", dest="rope_original_max_position", type=parse_token_count,
                   default=None, help="the pre-YaRN window (default: the config's max_position_embeddings)")
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1, metavar="N",
                   help="plan one rank of N tensor-parallel ranks (default %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of text")


def _config_path(model: str) -> Any:
    """A config.json, a directory with one, or anything else resolve_model accepts (a .gguf file
    is converted; a hub id gets the one-line hint to download it first)."""
    from pathlib import Path
    p = Path(model)
    if p.is_file() and p.suffix == ".json" or (p / "config.json").is_file():
        return p
    from ninfer.checkpoints import resolve_model
    return resolve_model(model)


def _model_name(model: str) -> str:
    from pathlib import Path
    p = Path(model)
    return (p.parent if p.suffix == ".json" else p).name or model


def _kv_dtypes(args: argparse.Namespace) -> list[str]:
    from ninfer.kvcache.formats import FORMAT_NAMES, get_format
    if not args.kv_dtype:
        return [n for n in FORMAT_NAMES if n != "auto"]
    names = [n.strip() for item in args.kv_dtype for n in item.split(",") if n.strip()]
    return [get_format(n).name for n in names]  # ValueError for unknown/refused names


def plan_table(model: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per kv-dtype: the plan (as a dict) or the refusal with its numbers."""
    from ninfer.engine.engine import declared_cache_spec
    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.planner import (GiB, ContextDoesNotFit, _torch_dtype, default_cache_spec, plan_memory,
                                        resolve_weights_dtype)
    from ninfer.layers.tp_geometry import local_config
    mem = int(args.memory * GiB)
    wdtype = resolve_weights_dtype(args.weights_dtype, model)
    tp = getattr(args, "tensor_parallel_size", 1)
    rank = local_config(model, tp)  # one rank's heads
    rows = []
    for name in _kv_dtypes(args):
        try:  # what the engine would allocate, layer by layer
            spec = declared_cache_spec(rank, get_format(name))
        except ValueError:  # not servable here (yet): the config's arithmetic alone, as before
            spec = default_cache_spec(rank, name)
        row: dict[str, Any] = {"kv_dtype": name, "bytes_per_token": spec.bytes_per_token(_torch_dtype(wdtype))}
        try:
            plan = plan_memory(model, kv_dtype=name, total_bytes=mem, free_bytes=mem, max_context=args.max_context,
                               kv_capacity=args.kv_capacity, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens, weights_dtype=args.weights_dtype,
                               device_type="cuda", enforce_eager=args.enforce_eager, cache_spec=spec,
                               tensor_parallel_size=tp)
            row.update(fits=True, largest_context=plan.largest_context, plan=plan.as_dict())
        except ContextDoesNotFit as e:
            row.update(fits=False, largest_context=e.largest_context, needed_bytes=e.needed_bytes,
                       available_bytes=e.available_bytes, error=str(e))
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from ninfer.model_config import ConfigError, ModelConfig
    from ninfer.layers.rotary import apply_rope_overrides, scaled_max_position
    from ninfer.kvcache.planner import GiB, format_bytes, resolve_weights_dtype
    from ninfer import dtypes
    from ninfer.layers.tp_geometry import check_tensor_parallel, shard_param_count
    tp = args.tensor_parallel_size
    try:
        if not args.memory > 0:
            raise ValueError(f"--memory must be > 0 GiB, got {args.memory}")
        model = apply_rope_overrides(ModelConfig.load(_config_path(args.model)), args.rope_yarn_factor,
                                     args.rope_original_max_position)
        check_tensor_parallel(model, tp, _model_name(args.model))
        # The default context is the one the engine would use: the rope-scaled window.
        limit = scaled_max_position(model)
        args.max_context = args.max_context or limit
        rows = plan_table(model, args)
    except (ConfigError, ValueError, OSError) as e:
        print(f"ninfer plan: error: {e}", file=sys.stderr)
        return 2
    ctx = args.max_context
    if ctx > limit:  # the engine warns the same way at startup
        print(f"ninfer plan: warning: max_context={ctx} exceeds the model's {limit} positions (rope scaling "
              f"included); quality past {limit} tokens is not what the model was trained for "
              "(--rope-yarn-factor extends the window)", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": str(args.model), "architecture": model.architecture, "memory_gib": args.memory,
                          "max_context": ctx, "kv_layers": model.num_kv_layers, "kv_heads": model.num_kv_heads,
                          "head_dim": model.head_dim, "tensor_parallel_size": tp, "rows": rows}, indent=2))
        return 0 if all(r["fits"] for r in rows) else 1
    default = " (default; --memory to change)" if args.memory == DEFAULT_MEMORY_GIB else ""
    print(f"model: {args.model} ({model.architecture}) layers={model.num_layers} kv-layers={model.num_kv_layers} "
          f"kv-heads={model.num_kv_heads} head_dim={model.head_dim} params={model.num_params() / 1e9:.2f}B")
    wd = resolve_weights_dtype(args.weights_dtype, model)
    from ninfer.quant import parse_quant_config
    qc = parse_quant_config(model.raw)
    if tp > 1:
        shard = shard_param_count(model, tp) * dtypes.num_bytes(wd)
        print(f"tensor parallel: {tp} ranks; every number below is one rank's (kv-heads={model.num_kv_heads // tp} "
              f"heads={model.num_heads // tp} per rank)")
        print(f"weights: {format_bytes(shard)} per rank, {format_bytes(tp * shard)} for the group ({wd}, from the "
              "config's geometry)")
    else:
        print(f"weights: {format_bytes(model.weight_bytes(wd))} ({wd}{f', linears {qc.name}' if qc else ''}, "
              "from the config's geometry)")
    print(f"device memory: {format_bytes(args.memory * GiB)}{' per rank' if tp > 1 else ''}{default}; max_context={ctx} "
          f"max_num_seqs={args.max_num_seqs} prefill_chunk={args.max_num_batched_tokens} "
          f"cuda_graphs={'off' if args.enforce_eager else 'on'}")
    w = 16 if tp > 1 else 12
    print(f"{'kv-dtype':<10} {'bytes/token' + ('/rank' if tp > 1 else ''):>{w}} {'largest-context':>16} {'fits':>5}")
    for r in rows:
        print(f"{r['kv_dtype']:<10} {r['bytes_per_token']:>{w}} {r['largest_context']:>16} "
              f"{'yes' if r['fits'] else 'NO':>5}")
    for r in rows:
        print(f"[{r['kv_dtype']}] " + (r["plan"]["capacity_line"] if r["fits"] else f"refused: {r['error']}"))
    return 0 if all(r["fits"] for r in rows) else 1
