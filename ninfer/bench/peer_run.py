"""The two engines' measurements for `ninfer bench peer`: llama-bench / llama-perplexity runs and the parsing of
their output, and ninfer's equivalents on the same model (speed at a depth through the engine's prefix cache,
next-token KL through kv_sim's quantize-in-torch path on the same tokens and chunks as llama-perplexity)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from ninfer.bench.peer_build import PeerError, tool

LLAMA_KV = ("f16", "q8_0", "q4_0")


# -- llama.cpp: running and parsing -------------------------------------------------------------
def run_tool(cmd: list[str], log=print, timeout: float | None = None, merge: bool = False) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool; merge: stderr into stdout (llama-perplexity's log thread writes its summary to
    stdout, and with the two streams on separate pipes its tail was seen lost at exit)."""
    log("+ " + " ".join(cmd))
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerError(f"{Path(cmd[0]).name} ran past {timeout:.0f} s")
    if r.returncode != 0:
        tail = "\n".join((r.stdout + (r.stderr or "")).strip().splitlines()[-15:])
        raise PeerError(f"{Path(cmd[0]).name} failed (exit {r.returncode}):\n{tail}")
    return r


def parse_bench_json(text: str) -> list[dict[str, Any]]:
    """llama-bench -o json: one row per test -> {test, kv, depth, n_prompt, n_gen, tok_s, stddev, samples}."""
    start = text.find("[")
    try:
        rows = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as e:
        raise PeerError(f"llama-bench printed no JSON array: {e}")
    if not isinstance(rows, list):
        raise PeerError("llama-bench printed no JSON array")
    out = []
    for r in rows:
        if r.get("type_k") != r.get("type_v"):
            raise PeerError(f"llama-bench row with K {r.get('type_k')} and V {r.get('type_v')}: give one type for both")
        test = "prefill" if r["n_prompt"] and not r["n_gen"] else "decode" if r["n_gen"] and not r["n_prompt"] else "mixed"
        out.append({"test": test, "kv": r["type_k"], "depth": int(r.get("n_depth", 0)), "n_prompt": r["n_prompt"],
                    "n_gen": r["n_gen"], "tok_s": float(r["avg_ts"]), "stddev": float(r["stddev_ts"]),
                    "samples": [float(x) for x in r.get("samples_ts", [])], "flash_attn": r.get("flash_attn"),
                    "backends": r.get("backends"), "gpu_info": r.get("gpu_info"), "build_commit": r.get("build_commit")})
    return out


_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*?"
                      r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")


def parse_kv_line(log_text: str) -> dict[str, Any] | None:
    """llama.cpp's own KV report ('llama_kv_cache: size = ... MiB (N cells, L layers ...), K (t): ..., V (t): ...')
    as bytes per token; None when the log has no such line. MiB are printed rounded to 2 decimals."""
    m = _KV_LINE.search(log_text)
    if not m:
        return None
    mib, cells = float(m.group(1)), int(m.group(2))
    return {"kv_mib": mib, "cells": cells, "layers": int(m.group(3)), "type_k": m.group(4), "type_v": m.group(6),
            "bytes_per_token": mib * 2**20 / cells}


_NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"


def parse_kld(log_text: str) -> dict[str, Any]:
    """llama-perplexity --kl-divergence's summary: mean KL (nats) with its uncertainty, max / median / 99%
    KLD, same-top-token rate, and the chunks and context it ran."""
    def grab(label: str, pm: bool = False):
        m = re.search(re.escape(label) + r"\s*:?\s*" + _NUM + (r"\s*±\s*" + _NUM if pm else ""), log_text)
        if not m:
            return None
        return (float(m.group(1)), float(m.group(2))) if pm else float(m.group(1))
    mean = grab("Mean    KLD:", pm=True)
    if mean is None:
        raise PeerError("llama-perplexity printed no 'Mean    KLD' line (was --kl-divergence given?)")
    top = grab("Same top p:", pm=True)
    chunks = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log_text) or \
        re.search(r"(\d+) chunks, n_ctx=(\d+)", log_text)
    return {"mean_kl": mean[0], "mean_kl_unc": mean[1], "max_kl": grab("Maximum KLD:"), "median_kl": grab("Median  KLD:"),
            "p99_kl": grab("99.0%   KLD:"), "same_top_pct": top[0] if top else None,
            "same_top_unc_pct": top[1] if top else None,
            "chunks": int(chunks.group(1)) if chunks else None, "n_ctx": int(chunks.group(2)) if chunks else None}


def llama_bench(bin_dir: Path, gguf: Path, depths: list[int], kvs: list[str], *, n_prompt: int, n_gen: int,
                repeats: int, ngl: int, log=print) -> list[dict[str, Any]]:
    """One llama-bench process per KV type (every depth, prefill and decode)."""
    rows = []
    for kv in kvs:
        cmd = [str(tool(bin_dir, "llama-bench")), "-m", str(gguf), "-fa", "1", "-ngl", str(ngl), "-p", str(n_prompt),
               "-n", str(n_gen), "-d", ",".join(map(str, depths)), "-ctk", kv, "-ctv", kv, "-r", str(repeats),
               "-o", "json"]
        rows += parse_bench_json(run_tool(cmd, log).stdout)
    return rows


def llama_kl(bin_dir: Path, gguf: Path, text: Path, work: Path, kvs: list[str], *, ctx: int, ngl: int,
             log=print) -> dict[str, Any]:
    """f16-KV logits saved once (--kl-divergence-base), then each quantized KV scored against them."""
    exe = str(tool(bin_dir, "llama-perplexity"))
    base = work / f"{gguf.stem}.f16kv.kld"
    # -lv 4: the KV cache's size line and its rotation flags are logged at that verbosity
    common = ["-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-fa", "1", "-ngl", str(ngl), "-lv", "4"]
    r = run_tool([exe, *common, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base)], log, merge=True)
    out: dict[str, Any] = {"reference": "f16", "base_file": str(base), "kv_bytes_per_token": {"f16": parse_kv_line(r.stdout)},
                           "results": {}}
    ppl = re.search(r"Final estimate: PPL = " + _NUM + r" \+/- " + _NUM, r.stdout)
    out["ppl_f16"] = (float(ppl.group(1)), float(ppl.group(2))) if ppl else None
    for kv in kvs:
        r = run_tool([exe, *common, "-ctk", kv, "-ctv", kv, "--kl-divergence-base", str(base), "--kl-divergence"], log, merge=True)
        text_out = r.stdout
        out["results"][kv] = parse_kld(text_out)
        out["kv_bytes_per_token"][kv] = parse_kv_line(text_out)
        rot = re.search(r"attn_rot_k = (\d+).*?attn_rot_v = (\d+)", text_out, re.S)
        out["results"][kv]["attn_rot_kv"] = [int(rot.group(1)), int(rot.group(2))] if rot else None
    return out


# -- ninfer: KL on llama-perplexity's chunks ----------------------------------------------------
def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunking: len(ids) // ctx chunks of ctx tokens, the first token of each replaced by
    BOS when the model adds one; logits at positions ctx//2 .. ctx-2 are scored (the next ctx - 1 - ctx//2 tokens)."""
    n = len(ids) // ctx
    if n < 1:
        raise PeerError(f"the text has {len(ids)} tokens, fewer than one --ctx {ctx} chunk")
    out = []
    for i in range(n):
        c = list(ids[i * ctx:(i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def read_kld_tokens(path: Path) -> tuple[int, int, list[int]]:
    """(n_ctx, n_vocab, tokens) of a llama-perplexity --kl-divergence-base file: '_logits_', int32 n_ctx,
    n_vocab, n_chunk, then the n_chunk * n_ctx token ids it scored (before the per-chunk BOS), then logits."""
    import struct
    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:8] != b"_logits_":
            raise PeerError(f"{path} is not a llama-perplexity --kl-divergence-base file")
        n_ctx, n_vocab, n_chunk = struct.unpack("<3i", head[8:])
        raw = f.read(4 * n_ctx * n_chunk)
    if len(raw) != 4 * n_ctx * n_chunk:
        raise PeerError(f"{path} is truncated")
    return n_ctx, n_vocab, list(struct.unpack(f"<{n_ctx * n_chunk}i", raw))


def ninfer_kl(model_dir: str, ids: list[int], kvs: list[str], *, ctx: int, reference: str = "bf16",
              add_bos: bool = False, device: str = "auto", log=print) -> dict[str, Any]:
    """KL(reference-KV || kv) per scored position of llama-perplexity's token ids and chunks, kv_sim's
    quantize-in-torch attention on the model in float32; mean with its standard error, max, median, 99th
    percentile and same-top-token rate, as llama-perplexity reports them."""
    import torch

    from ninfer.bench import kv_sim
    model, tok = kv_sim.load(model_dir, device)
    bos = tok.bos_token_id if add_bos else None
    batch = torch.tensor(chunks(ids, ctx, bos), device=model.device)
    first = ctx // 2
    stats = kv_sim.centring_stats(model, tok, kvs)  # `+c` names: the engine's key centring

    def logprobs(codec_name: str) -> torch.Tensor:
        keys = stats.get(kv_sim.centred(codec_name))
        with kv_sim.quantized_kv(model, kv_sim.format_codec(codec_name), keys=keys), torch.no_grad():
            return torch.cat([torch.log_softmax(model(input_ids=row[None], use_cache=False).logits[0, first:ctx - 1]
                                                .double(), -1).cpu() for row in batch])

    ref = logprobs(reference)
    out: dict[str, Any] = {"reference": reference, "tokens": len(ids), "chunks": int(batch.shape[0]), "n_ctx": ctx,
                           "scored": int(ref.shape[0]), "results": {}}
    for kv in kvs:
        log(f"  ninfer kl {kv} vs {reference}")
        lp = logprobs(kv)
        k = kv_sim.kl(ref, lp)
        n = k.numel()
        out["results"][kv] = {
            "mean_kl": float(k.mean()), "mean_kl_unc": float(k.std() / math.sqrt(n)) if n > 1 else None,
            "max_kl": float(k.max()), "median_kl": float(k.median()), "p99_kl": float(torch.quantile(k, 0.99)),
            "same_top_pct": 100.0 * float((lp.argmax(-1) == ref.argmax(-1)).double().mean())}
    return out


# -- ninfer: speed at a depth -------------------------------------------------------------------
def ninfer_speed(args: Any, depths: list[int], kvs: list[str], *, n_prompt: int, n_gen: int, repeats: int,
                 log=print) -> dict[str, Any]:
    """Per kv-dtype, one engine with prefix reuse on: a depth-d random prompt is prefilled untimed, then each
    repeat times d + n_prompt fresh tokens (TTFT = prefill of n_prompt at depth d, since the first d come from
    the cache) and, separately, n_gen tokens decoded after d + 1 (decode at depth d, as llama-bench's tg)."""
    from ninfer.bench import _timing as T
    results: dict[str, Any] = {}
    for kv in kvs:
        T.release()
        cfg = T.base_config(args, kv_dtype=kv, enable_prefix_caching=True,
                            max_context=args.max_context or max(depths) + n_prompt + n_gen)
        log(f"[peer] ninfer {kv}: depths {depths}")
        try:
            engine = T.start_engine(cfg)
        except Exception as e:  # a refused start of one kv-dtype must not hide the others
            results[kv] = {"error": f"{type(e).__name__}: {e}"}
            continue
        try:
            vocab = engine.model_config.vocab_size
            res: dict[str, Any] = {"engine": T.engine_facts(engine), "bytes_per_token": engine.pool.bytes_per_token,
                                   "depths": {}}
            T.timed_request(engine, f"{kv}-warm", T.random_prompt(vocab, min(n_prompt, 512), body_seed=99, head_seed=99), 8)
            for d in depths:
                prefix = T.random_prompt(vocab, d, body_seed=1000 + d, head_seed=d) if d else []
                if d:
                    T.timed_request(engine, f"{kv}-fill{d}", prefix, 1)
                reps = []
                for r in range(repeats):
                    tail = T.random_prompt(vocab, n_prompt + 1, body_seed=7 + r, head_seed=50 + r)
                    pre = T.timed_request(engine, f"{kv}-p{d}-{r}", prefix + tail[:n_prompt], 1)
                    dec = T.timed_request(engine, f"{kv}-g{d}-{r}", prefix + tail[n_prompt:], n_gen)
                    reps.append({"prefill_tok_s": n_prompt / pre["ttft_s"], "prefill_cached": pre["cached_tokens"],
                                 "decode_tok_s": dec["decode_tok_s"], "decode_cached": dec["cached_tokens"]})
                page = d - min(x["prefill_cached"] for x in reps)
                row = {"repeats": reps, "prefill_tok_s": T.median([x["prefill_tok_s"] for x in reps]),
                       "decode_tok_s": T.median([x["decode_tok_s"] for x in reps])}
                if d and page > 64:  # more than one page of the depth recomputed: the timing holds the depth's prefill
                    row["error"] = f"only {d - page} of {d} depth tokens came from the prefix cache"
                res["depths"][str(d)] = row
                log(f"  d={d}: prefill {T.fmt(row['prefill_tok_s'])} tok/s  decode {T.fmt(row['decode_tok_s'], ',.1f')} tok/s")
            results[kv] = res
        except Exception as e:
            results[kv] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            del engine
            T.release()
    return results


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
