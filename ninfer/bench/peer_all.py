"""`ninfer bench peer all`: build llama.cpp, make the checkpoints and their GGUFs, run speed and KL for each
model, and write JSON per stage plus one markdown table (peer.md, printed last) to --out-dir. Stages can be
run in separate commands (--stages) against the same --work and --bin-dir; each reuses what is already there."""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ninfer.bench import peer_build as B
from ninfer.bench import peer_run as R
from ninfer.bench.peer_build import PeerError


def _fmt(x: Any, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def speed_table(res: dict[str, Any]) -> str:
    lines = [f"speed at depth, batch 1: {Path(res['model']).name} ({res['settings']['prompt']} tokens prefilled, "
             f"{res['settings']['gen']} decoded after the depth; median of {res['settings']['repeats']})",
             "| depth | engine | KV | KV bytes/token | prefill tok/s | decode tok/s |", "|---|---|---|---|---|---|"]
    lbytes = res.get("llama_kv_bytes_per_token") or {}
    for d in res["settings"]["depths"]:
        for row in res["llama_cpp"]:
            if row["depth"] != d or row["test"] != "prefill":
                continue
            dec = next((r for r in res["llama_cpp"] if r["depth"] == d and r["kv"] == row["kv"]
                        and r["test"] == "decode"), None)
            lines.append(f"| {d} | llama.cpp | {row['kv']} | {_fmt(lbytes.get(row['kv']))} | {_fmt(row['tok_s'])} | "
                         f"{_fmt(dec and dec['tok_s'], ',.1f')} |")
        for kv, v in res["ninfer"].items():
            if "error" in v:
                lines.append(f"| {d} | ninfer | {kv} | failed: {v['error'][:80]} | | |")
                continue
            r = v["depths"].get(str(d), {})
            note = f" ({r['error']})" if "error" in r else ""
            lines.append(f"| {d} | ninfer | {kv} | {_fmt(v['bytes_per_token'])} | {_fmt(r.get('prefill_tok_s'))}{note} | "
                         f"{_fmt(r.get('decode_tok_s'), ',.1f')} |")
    return "\n".join(lines)


def kl_table(res: dict[str, Any]) -> str:
    n = res["ninfer"]
    lines = [f"next-token KL on {Path(res['text']).name}: {Path(res['model']).name}, {n['chunks']} chunks of "
             f"{res['ctx']} tokens, {n['scored']} scored positions (the second half of each chunk)",
             "| engine | KV | vs | mean KL (nats) | median | 99% | max | same top-1 % |", "|---|---|---|---|---|---|---|---|"]
    for engine, part in (("llama.cpp", res["llama_cpp"]), ("ninfer", n)):
        for kv, r in part["results"].items():
            lines.append(f"| {engine} | {kv} | {part['reference']} | {r['mean_kl']:.3e} ± {_fmt(r['mean_kl_unc'], '.1e')} | "
                         f"{_fmt(r['median_kl'], '.2e')} | {_fmt(r['p99_kl'], '.2e')} | {_fmt(r['max_kl'], '.2e')} | "
                         f"{_fmt(r['same_top_pct'], '.2f')} |")
    return "\n".join(lines)


# -- models --------------------------------------------------------------------------------------
def make_models(names: list[str], work: Path, src: Path, build: bool, log=R.stderr_log) -> dict[str, dict[str, Any]]:
    """name -> {hf, gguf} (or {skipped: why}). With build, missing checkpoints / GGUFs are made."""
    from ninfer.bench.peer import model_dir
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.time()
        gguf = work / f"{name}.bf16.gguf"
        if name == "qwen3-8b":
            # the probe model's tokenizer: llama.cpp knows no pre-tokenizer that splits as it does, so the GGUF
            # declares gpt-2's; speed feeds token ids and KL scores llama.cpp's ids in both engines
            hf, pre = work / "qwen3-8b", "gpt-2"
            if build and not (hf / "config.json").is_file():
                cmd = [sys.executable, "-m", "ninfer.tools.random_checkpoint", "--preset", "qwen3-8b", "--out", str(hf)]
                log("+ " + " ".join(cmd))
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    out[name] = {"skipped": f"random_checkpoint failed: {(r.stderr or r.stdout).strip()[-300:]}"}
                    continue
        else:
            try:
                hf, pre = model_dir(name), None
            except PeerError as e:
                out[name] = {"skipped": str(e)}
                log(f"[peer] {name}: skipped: {e}")
                continue
        if build and not gguf.is_file():
            B.convert(src, Path(hf), gguf, "bf16", pre, log=log)
        if not (Path(hf) / "config.json").is_file() or not gguf.is_file():
            out[name] = {"skipped": f"no checkpoint / GGUF under {work} (run the models stage)"}
            continue
        out[name] = {"hf": str(hf), "gguf": str(gguf), "pre_override": pre, "seconds": round(time.time() - t0, 1)}
    return out


def depths_for(hf: str, depths: list[int], extra: int) -> list[int]:
    """The depths whose context fits the model's max_position_embeddings."""
    cfg = json.loads((Path(hf) / "config.json").read_text())
    top = int(cfg.get("max_position_embeddings") or 1 << 30)
    return [d for d in depths if d + extra <= top]


def run_all(args: argparse.Namespace) -> int:
    from ninfer.bench import peer
    stages = peer._names(args.stages, peer.STAGES, "--stages")
    names = peer._names(args.models, peer.MODELS, "--models")
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    tables: list[str] = []
    failed: list[str] = []
    if args.bin_dir is not None:
        B.tool(args.bin_dir, "llama-bench")
        bin_dir = args.bin_dir
    elif "build" in stages:
        res = B.build(args.src, args.build_dir, backend=args.backend, arch=args.cuda_arch, jobs=args.jobs,
                      save_bin=args.save_bin, log=R.stderr_log)
        peer.write(out_dir / "build.json", res)
        tables.append(f"llama.cpp build ({res['backend']}, arch {res['cuda_arch']}, -j {res['jobs']}): {res['seconds']:.0f} s")
        bin_dir = Path(res["bin_dir"])
    else:
        bin_dir = args.save_bin or args.build_dir / "bin"
    peer.use_gguf_py(args.src)
    models = make_models(names, args.work, args.src, "models" in stages)
    peer.write(out_dir / "models.json", models)
    for name, m in models.items():
        if "skipped" in m:
            tables.append(f"{name}: skipped: {m['skipped']}")
            continue
        a = copy.copy(args)
        a.bin_dir = bin_dir
        if "speed" in stages:
            a.depths = ",".join(map(str, depths_for(m["hf"], peer._tokens(args.depths, "--depths"), args.prompt + args.gen)))
            try:
                res = peer.speed(a, Path(m["hf"]), Path(m["gguf"]))
                peer.write(out_dir / f"speed-{name}.json", res)
                tables.append(speed_table(res))
            except PeerError as e:
                failed.append(f"speed {name}: {e}")
        if "kl" in stages:
            try:
                res = peer.kl(a, Path(m["hf"]), Path(m["gguf"]), args.work)
                peer.write(out_dir / f"kl-{name}.json", res)
                tables.append(kl_table(res))
            except PeerError as e:
                failed.append(f"kl {name}: {e}")
    tables += [f"FAILED {f}" for f in failed]
    text = "\n\n".join(tables) + "\n"
    (out_dir / "peer.md").write_text(text)
    print(text)
    return 1 if failed else 0

