"""`ninfer` command line: a table of subcommands, each a module with `add_arguments(parser)`
and `run(args) -> int`. Only the chosen module is imported, so `ninfer plan` never loads torch
kernels and a broken optional piece cannot break the others."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("ninfer.kvcache.plan_cli", "capacity table per kv-dtype from a config.json alone"),
    "generate": ("ninfer.engine.generate_cli", "generate text for a prompt (offline engine)"),
    "serve": ("ninfer.server.cli", "OpenAI-compatible HTTP server (same as ninfer-serve)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "codec": ("ninfer.bench.codec", "SNR and bits/value of every KV codec"),
    "kernels": ("ninfer.bench.kernels", "attention/store kernel timings vs copy bandwidth (GPU)"),
    "needle": ("ninfer.bench.needle", "needle-in-a-haystack grid per kv-dtype x context x depth"),
    "sanity": ("ninfer.bench.sanity", "fixed prompts vs an int8 control"),
    "kl": ("ninfer.bench.kl", "next-token KL of each kv-dtype against bf16 KV"),
    "matched": ("ninfer.bench.matched", "same model and prompt, only --kv-dtype differs"),
    "sweep": ("ninfer.bench.sweep", "prefill/decode speed from 32K to the largest context"),
    "memory": ("ninfer.bench.memory", "planned vs allocated vs device-peak memory"),
    "prefill": ("ninfer.bench.prefill", "TTFT and prefill tok/s per kv-dtype vs transformers; prefill kernels vs SDPA"),
}


def _available(table: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    out = {}
    for name, (mod, helptext) in table.items():
        try:
            if importlib.util.find_spec(mod) is not None:
                out[name] = (mod, helptext)
        except ModuleNotFoundError:
            pass
    return out


def _usage(prog: str, table: dict[str, tuple[str, str]]) -> str:
    lines = [f"usage: {prog} <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {h}" for name, (_, h) in table.items()]
    return "\n".join(lines)


def _dispatch(prog: str, module: str, argv: list[str]) -> int:
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=prog, description=(mod.__doc__ or "").strip().split("\n")[0])
    mod.add_arguments(parser)
    args = parser.parse_args(argv)
    return int(mod.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _available(COMMANDS)
    if not argv or argv[0] in ("-h", "--help"):
        benches = _available(BENCHES)
        print(_usage("ninfer", commands) + "\n  bench      " + ", ".join(benches))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "bench":
        benches = _available(BENCHES)
        if not rest or rest[0] in ("-h", "--help") or rest[0] not in benches:
            print(_usage("ninfer bench", benches), file=sys.stderr if rest[:1] and rest[0] not in ("-h", "--help") else sys.stdout)
            if rest and rest[0] not in ("-h", "--help"):
                print(f"ninfer bench: unknown benchmark {rest[0]!r}", file=sys.stderr)
                return 2
            return 0 if rest else 2
        return _dispatch(f"ninfer bench {rest[0]}", benches[rest[0]][0], rest[1:])
    if name not in commands:
        print(_usage("ninfer", commands), file=sys.stderr)
        print(f"ninfer: unknown command {name!r}", file=sys.stderr)
        return 2
    return _dispatch(f"ninfer {name}", commands[name][0], rest)


def serve_main(argv: list[str] | None = None) -> int:
    return _dispatch("ninfer-serve", COMMANDS["serve"][0], list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
