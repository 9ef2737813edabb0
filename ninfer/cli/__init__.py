"""`ninfer` command line: a table of subcommands, each a module with `add_arguments(parser)`
and `run(args) -> int`. Only the chosen module is imported, so `ninfer plan` never loads torch
kernels and a broken optional piece cannot break the others."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("ninfer.cli.plan", "capacity table per kv-dtype from a config.json alone"),
    "generate": ("ninfer.cli.generate", "generate text for a prompt (offline engine)"),
    "serve": ("ninfer.server.cli", "OpenAI-compatible HTTP server (same as ninfer-serve)"),
}


def available(table: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    out = {}
    for name, (mod, helptext) in table.items():
        try:
            if importlib.util.find_spec(mod) is not None:
                out[name] = (mod, helptext)
        except ModuleNotFoundError:
            pass
    return out


def usage(prog: str, table: dict[str, tuple[str, str]]) -> str:
    lines = [f"usage: {prog} <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {h}" for name, (_, h) in table.items()]
    return "\n".join(lines)


def description(doc: str | None) -> str:
    """A module docstring's first paragraph, as one line for argparse to wrap."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def dispatch(prog: str, module: str, argv: list[str]) -> int:
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=prog, description=description(mod.__doc__))
    mod.add_arguments(parser)
    args = parser.parse_args(argv)
    return int(mod.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    from ninfer.cli.bench import BENCHES
    from ninfer.cli.bench import main as bench_main
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = available(COMMANDS)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage("ninfer", commands) + "\n  bench      " + ", ".join(available(BENCHES))
              + "\n\n`ninfer <command> --help` for its options; `ninfer --version` for the version.")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version", "version"):
        from ninfer import __version__
        print(f"ninfer {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "bench":
        return bench_main(rest)
    if name not in commands:
        print(usage("ninfer", commands), file=sys.stderr)
        print(f"ninfer: unknown command {name!r}", file=sys.stderr)
        return 2
    return dispatch(f"ninfer {name}", commands[name][0], rest)


def serve_main(argv: list[str] | None = None) -> int:
    return dispatch("ninfer-serve", COMMANDS["serve"][0], list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
