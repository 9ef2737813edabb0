"""`ninfer bench <name>`: the table of benchmarks, each a module under ninfer.bench with
`add_arguments(parser)` and `run(args) -> int`."""
from __future__ import annotations

import sys

BENCHES: dict[str, tuple[str, str]] = {
    "codec": ("ninfer.bench.codec", "SNR and bits/value of every KV codec"),
    "kernels": ("ninfer.bench.kernels", "attention/store kernel timings vs copy bandwidth (GPU)"),
    "needle": ("ninfer.bench.needle", "needle-in-a-haystack grid per kv-dtype x context x depth"),
    "sanity": ("ninfer.bench.sanity", "fixed prompts vs an int8 control"),
    "kl": ("ninfer.bench.kl", "next-token KL of each kv-dtype against bf16 KV"),
    "matched": ("ninfer.bench.matched", "same model and prompt, only --kv-dtype differs"),
    "sweep": ("ninfer.bench.sweep", "prefill/decode speed from 32K to the largest context"),
    "memory": ("ninfer.bench.memory", "planned vs allocated vs device-peak memory"),
    "serve": ("ninfer.bench.serve", "load generator over the OpenAI API: throughput, TTFT, ITL"),
    "prefill": ("ninfer.bench.prefill", "TTFT and prefill tok/s per kv-dtype, vs transformers and SDPA"),
    "gemm": ("ninfer.bench.gemm", "FP8 / NVFP4 weight GEMMs vs bf16 at Qwen3-8B shapes (GPU)"),
    "structured": ("ninfer.bench.structured", "decode step time with vs without a json_schema constraint"),
    "peer": ("ninfer.bench.peer", "llama.cpp side by side: build it, same weights, speed at depth and KV KL"),
}


def main(argv: list[str]) -> int:
    from ninfer.cli import available, dispatch, usage
    benches = available(BENCHES)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage("ninfer bench", benches))
        return 0 if argv else 2
    if argv[0] not in benches:
        print(usage("ninfer bench", benches), file=sys.stderr)
        print(f"ninfer bench: unknown benchmark {argv[0]!r}", file=sys.stderr)
        return 2
    return dispatch(f"ninfer bench {argv[0]}", benches[argv[0]][0], argv[1:])
