"""Constrained-decoding overhead: decode step time with and without a json_schema constraint on the
same engine, at each batch size (default 1 and 32), plus a batch with one constrained request
(what the unconstrained ones pay for sharing a batch with it).

Per (batch B, mode): B requests of random prompt ids, greedy, EOS ignored, run together through
LLMEngine.step(); timed are the decode steps where all B are running, after --skip-steps; the
median step time is each request's time per token. Modes: `free` (no constraint), `json` (every
request under --schema; the default, an array of at least 64 objects, cannot end within the
timed steps), `one` (request 0 constrained, the others free). The bitmask fill (host) is timed
on its own. Every constrained output is checked against the grammar's vocabulary: a bench that
produced invalid JSON prefixes would be measuring something else.

Random-weight checkpoints carry a small tokenizer, and the mask cost grows with the vocabulary,
so --grammar-vocab N (default: the model's vocab_size) gives xgrammar a synthetic byte-level-like
vocabulary of N tokens (all bytes, then random words with and without a leading space, digits and
JSON punctuation); token id t means the same string to the grammar and to the checker. 0 = use
the model's own tokenizer (real checkpoints)."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from ninfer.bench import _timing as T
from ninfer.config import parse_token_count

DEFAULT_SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "ok": {"type": "boolean"}}}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    T.add_common_arguments(p, kv_default="int8")
    b = p.add_argument_group("benchmark")
    b.add_argument("--batches", default="1,32", help="batch sizes, comma-separated (default %(default)s)")
    b.add_argument("--prompt-tokens", type=parse_token_count, default=128, help="default %(default)s")
    b.add_argument("--gen-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    b.add_argument("--skip-steps", type=int, default=4, help="decode steps not timed at the start (default %(default)s)")
    b.add_argument("--schema", default=None, help="JSON schema (text or @file); default: an array of >= 64 objects")
    b.add_argument("--grammar-vocab", type=int, default=None,
                   help="synthetic vocabulary size for the grammar (default: the model's vocab_size; 0 = its tokenizer)")


def synthetic_vocab(n: int, eos: int, seed: int = 0) -> list[bytes]:
    """n distinct token strings: the 256 bytes, then words of 1-10 letters (half with a leading
    space), numbers and JSON punctuation runs; `eos` is a special-looking token."""
    rng = random.Random(seed)
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    seen = set(vocab)
    punct = ['"', ",", ":", "{", "}", "[", "]", " ", "\n", "_", "-", "."]
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    while len(vocab) < n:
        r = rng.random()
        if r < 0.1:
            s = "".join(rng.choice(punct) for _ in range(rng.randint(2, 4)))
        elif r < 0.2:
            s = str(rng.randint(0, 99999))
        else:
            s = "".join(rng.choice(letters) for _ in range(rng.randint(1, 10)))
            s = (" " if rng.random() < 0.5 else "") + (s.capitalize() if rng.random() < 0.1 else s)
        tok = s.encode()
        if tok not in seen:
            seen.add(tok)
            vocab.append(tok)
    vocab = vocab[:n]
    if eos < n:
        vocab[eos] = b"<|endoftext|>"
    return vocab


def _use_synthetic_vocab(engine: Any, n: int) -> list[bytes]:
    import xgrammar as xgr

    from ninfer.engine.structured import GrammarCache
    eos = sorted(engine.eos_token_ids)
    vocab = synthetic_vocab(n, eos[0] if eos else n)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=engine.model_config.vocab_size,
                             stop_token_ids=eos or None)
    engine.grammars = GrammarCache(None, engine.model_config.vocab_size, eos, tokenizer_info=info)
    return vocab


def _timed_fill(engine: Any) -> list[float]:
    """Wrap the engine's bitmask fill to record each call's host time."""
    times: list[float] = []
    filler = engine._bitmasks
    inner = filler.fill

    def fill(states: list[Any]) -> Any:
        t = time.perf_counter()
        out = inner(states)
        times.append(time.perf_counter() - t)
        return out

    filler.fill = fill
    return times


def measure(engine: Any, batch: int, mode: str, spec: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from ninfer.engine.sampling import SamplingParams
    vocab = engine.model_config.vocab_size
    ids = []
    for i in range(batch):
        rid = f"{mode}-b{batch}-{i}"
        constrained = mode == "json" or (mode == "one" and i == 0)
        p = SamplingParams(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True,
                           structured=spec if constrained else None)
        engine.add_request(rid, T.random_prompt(vocab, args.prompt_tokens, body_seed=seed + i, head_seed=seed + i), p)
        ids.append(rid)
    step_s: list[float] = []
    outs: dict[str, Any] = {}
    n_decode = 0
    while engine.has_unfinished_requests():
        T.sync(engine.device)
        t = time.perf_counter()
        res = engine.step()
        T.sync(engine.device)
        dt = time.perf_counter() - t
        for o in res:
            outs[o.request_id] = o
        running = [outs.get(r) for r in ids]
        if all(o is not None and len(o.token_ids) >= 2 for o in running) and len(res) == batch:
            n_decode += 1   # a step where every request decoded one more token
            if n_decode > args.skip_steps:
                step_s.append(dt)
    short = [r for r in ids if len(outs[r].token_ids) < args.gen_tokens]
    if short:
        raise RuntimeError(f"{len(short)} request(s) ended early ({outs[short[0]].finish_reason}); "
                           "the schema must outlast --gen-tokens")
    return {"outputs": outs, "step_ms": 1e3 * statistics.median(step_s), "timed_steps": len(step_s)}


def _check(vocab: list[bytes] | None, engine: Any, out: Any) -> None:
    """The constrained output is a valid prefix of a JSON array (decoded as the grammar reads ids)."""
    text = (b"".join(vocab[t] for t in out.token_ids).decode("utf-8", "replace") if vocab is not None
            else engine.tokenizer.decode(out.token_ids))
    if not text.lstrip().startswith("["):
        raise RuntimeError(f"a constrained output does not start a JSON array: {text[:80]!r}")


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in str(args.batches).split(",") if b.strip()]
    kv = T.kv_dtypes(args.kv_dtype)[0]
    ctx = args.max_context or (args.prompt_tokens + args.gen_tokens + 64)
    cfg = T.base_config(args, kv_dtype=kv, max_context=ctx, enable_prefix_caching=False,
                        max_num_seqs=max(batches))
    engine = T.start_engine(cfg)
    from ninfer.engine.structured import StructuredSpec
    schema = args.schema or json.dumps(DEFAULT_SCHEMA)
    if schema.startswith("@"):
        schema = open(schema[1:]).read()
    n_vocab = engine.model_config.vocab_size if args.grammar_vocab is None else args.grammar_vocab
    vocab = _use_synthetic_vocab(engine, n_vocab) if n_vocab else None
    spec = StructuredSpec("json_schema", schema)
    t = time.perf_counter()
    engine.grammars.compile(spec)
    compile_s = time.perf_counter() - t
    fills = _timed_fill(engine)
    measure(engine, 1, "json", spec, args, seed=999)        # warm-up: kernels, graphs, allocator
    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        for mode in ("free", "json", "one"):
            if mode == "one" and b == 1:
                continue
            fills.clear()
            m = measure(engine, b, mode, spec, args, seed=1000 * b)
            for o in m["outputs"].values():
                if mode == "json" or (mode == "one" and o.request_id.endswith("-0")):
                    _check(vocab, engine, o)
            row[f"{mode}_step_ms"] = m["step_ms"]
            if mode != "free":
                row[f"{mode}_fill_ms"] = 1e3 * statistics.median(fills) if fills else None
        row["json_overhead_ms"] = row["json_step_ms"] - row["free_step_ms"]
        row["json_overhead_pct"] = T.pct(row["json_step_ms"], row["free_step_ms"])
        if "one_step_ms" in row:
            row["one_overhead_pct"] = T.pct(row["one_step_ms"], row["free_step_ms"])
        rows.append(row)
        print(f"batch {b:>3}: free {row['free_step_ms']:.2f} ms/token, json {row['json_step_ms']:.2f} "
              f"(+{row['json_overhead_ms']:.2f} ms, {row['json_overhead_pct']:+.1f}%, mask fill "
              f"{T.fmt(row.get('json_fill_ms'), '.2f')} ms)" +
              (f", one constrained of {b}: {row['one_step_ms']:.2f} ({row['one_overhead_pct']:+.1f}%)"
               if "one_step_ms" in row else ""), flush=True)
    T.write_json(args.json, {"env": T.environment(engine.device), "engine": T.engine_facts(engine),
                             "kv_dtype": kv, "grammar_vocab": n_vocab or len(engine.tokenizer),
                             "schema": json.loads(schema), "compile_s": compile_s, "prompt_tokens": args.prompt_tokens,
                             "gen_tokens": args.gen_tokens, "rows": rows})
    return 0

