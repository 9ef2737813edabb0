"""``ninfer bench kl MODEL --text --engine``: next-token KL on the shipped passages through the engine.

Each passage's first ``--tokens - --scored`` tokens are the prompt (prefill, chunked as the engine
chunks it); the last ``--scored`` tokens are forced one decode step at a time, and every step's
next-token distribution is compared with the reference format's (default bf16) after the same
history. So the real store, prefill and decode paths of each kv-dtype are measured, key centring and
the rk4v4-e8w window included, which the ``--text`` simulation (``kv_sim.py``) does not run. The
calibration passage of the key centring is not scored. ``--join`` scores every rotation of the
held-out passages joined into one document instead, for prompts longer than one passage.
"""
from __future__ import annotations

import argparse
import time
from typing import Any


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from ninfer import LLM
    from ninfer.bench import _timing as T
    from ninfer.bench import kv_sim
    from ninfer.bench.kl import compare, teacher_forced
    from ninfer.kvcache import centering

    kvs, ref_kv = T.kv_dtypes(args.kv_dtype), args.reference
    T.kv_dtypes(ref_kv)
    if not 1 <= args.scored < args.tokens:
        raise ValueError(f"--scored must be in [1, --tokens - 1], got {args.scored} with --tokens {args.tokens}")
    t0 = time.time()

    def engine(kv: str):
        return LLM(model, kv_dtype=kv, device=args.device, max_context=args.tokens + 8,
                   enable_prefix_caching=False, kv_centering=args.kv_centering)

    llm = engine(ref_kv)
    docs = kv_sim.documents()
    docs.pop(centering.PASSAGE.stem, None)
    if args.join:  # longer contexts than one passage: every rotation of the held-out passages, joined
        names = list(docs)
        docs = {"+".join(names[i:] + names[:i]): "\n\n".join(docs[n] for n in names[i:] + names[:i])
                for i in range(len(names))}
    ids = {k: v[0].tolist() for k, v in kv_sim.token_ids(llm.engine.tokenizer, docs, args.tokens).items()}
    short = [k for k, v in ids.items() if len(v) < args.tokens]
    if short:
        raise ValueError(f"passages shorter than --tokens {args.tokens}: {', '.join(short)}")
    names = list(ids)
    prompts = [ids[k][:-args.scored] for k in names]
    forced = [ids[k][-args.scored:] for k in names]
    _, ref = teacher_forced(llm, prompts, args.scored, forced)
    del llm
    rows = []
    for kv in kvs:
        llm = engine(kv)
        _, logits = teacher_forced(llm, prompts, args.scored, forced)
        del llm
        per_doc = {k: compare([ref[i]], [logits[i]]) for i, k in enumerate(names)}
        v = [d["mean_kl"] for d in per_doc.values()]
        rows.append({"kv_dtype": kv, "mean_kl": sum(v) / len(v), "min_doc": min(v), "max_doc": max(v),
                     "max_kl": max(d["max_kl"] for d in per_doc.values()),
                     "top1": sum(d["top1"] for d in per_doc.values()) / len(per_doc), "docs": per_doc})
    return {"bench": "kl-text-engine", "model": model, "reference": ref_kv, "tokens": args.tokens,
            "scored": args.scored, "passages": names, "rows": rows, "seconds": round(time.time() - t0, 1)}


def table(res: dict[str, Any]) -> str:
    lines = [f"next-token KL vs {res['reference']} KV through the engine, {len(res['passages'])} passages: "
             f"{res['tokens'] - res['scored']}-token prompt, {res['scored']} forced decode steps scored "
             "(mean over passages; min / max passage)",
             "| kv-dtype | mean KL (nats) | min passage | max passage | max KL | top-1 agreement |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['kv_dtype']} | {r['mean_kl']:.3e} | {r['min_doc']:.3e} | {r['max_doc']:.3e} | "
                     f"{r['max_kl']:.3e} | {r['top1']:.3f} |")
    return "\n".join(lines)
