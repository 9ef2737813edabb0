"""Generation sanity: fixed prompts through the identical harness for a KV format and for an
int8 control (DESIGN §7), reporting token-level agreement and exact match.

The prompts cover recall (a short needle document: what the probe model can do, so it must also
be right), exact arithmetic, code and an explanation (for the probe model these are only a
measure of agreement between the two KV formats). Greedy, prefix reuse off.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from ninfer.tools.probe import data, default_model_dir
from ninfer.tools.probe.evaluate import encoder

MAX_TOKENS = 48
CHAT_PROMPTS = [
    ("arithmetic", "What is 17 + 25? Answer with the number only."),
    ("code", "Write a Python function that returns the sum of a list of integers."),
    ("explanation", "Explain in two sentences why the sky is blue."),
]


def prompts(tokenizer) -> list[dict]:
    """The fixed prompt set: two recall documents, then the chat prompts."""
    tokenize = encoder(tokenizer)
    out = []
    for i, ctx in enumerate((512, 1024)):
        hay = data.make_haystack(random.Random(1000 + i), ctx, depths=[0.3, 0.7], tokenize=tokenize)
        n = hay.needles[i % 2]
        out.append({"name": f"recall-{ctx}", "prompt": data.chat_prompt(hay.text, n.key),
                    "expected": data.answer_text(n.key, n.value)})
    for name, text in CHAT_PROMPTS:
        p = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
        out.append({"name": name, "prompt": p, "expected": None})
    return out


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions (over the longer output) where both generated the same token."""
    n = max(len(a), len(b))
    return 1.0 if n == 0 else sum(x == y for x, y in zip(a, b)) / n


def generate(model_dir: str, kv_dtype: str, device: str, cases: list[dict]) -> list[dict]:
    from ninfer import LLM, SamplingParams
    llm = LLM(model_dir, kv_dtype=kv_dtype, device=device, max_context=2048, enable_prefix_caching=False)
    outs = llm.generate([c["prompt"] for c in cases], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    del llm
    return [{"text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason} for o in outs]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: the bundled probe model)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="rk4v4-e8")
    p.add_argument("--control", default="int8", help="control KV format (default %(default)s)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer
    from ninfer.checkpoints import resolve_model
    try:
        model_dir = str(resolve_model(args.model) if args.model else default_model_dir())
    except ValueError as e:
        raise SystemExit(f"ninfer bench sanity: {e}")
    cases = prompts(AutoTokenizer.from_pretrained(model_dir))
    t0 = time.time()
    test = generate(model_dir, args.kv_dtype, args.device, cases)
    ctrl = generate(model_dir, args.control, args.device, cases)
    rows, ok = [], True
    print(f"{'prompt':<13} {'agree':>6} {'exact':>6} {'correct':>8}  {args.kv_dtype} output")
    for c, t, k in zip(cases, test, ctrl):
        agree = agreement(t["token_ids"], k["token_ids"])
        exact = t["token_ids"] == k["token_ids"]
        correct = None if c["expected"] is None else (t["text"].strip() == c["expected"]
                                                       and t["finish_reason"] == "stop")
        ok &= correct is not False
        rows.append({"name": c["name"], "agreement": round(agree, 4), "exact_match": exact, "correct": correct,
                     "expected": c["expected"], args.kv_dtype: t, args.control: k})
        shown = t["text"].replace("\n", "\\n")[:60]
        print(f"{c['name']:<13} {agree:>6.2f} {str(exact):>6} {str(correct if correct is not None else '-'):>8}  {shown}")
    mean = sum(r["agreement"] for r in rows) / len(rows)
    n_exact = sum(r["exact_match"] for r in rows)
    print(f"sanity: {args.kv_dtype} vs {args.control}: token agreement {mean:.3f}, exact {n_exact}/{len(rows)}, "
          f"recall {'ok' if ok else 'FAILED'} ({time.time() - t0:.1f}s, model {model_dir})")
    if args.json:
        doc = {"bench": "sanity", "model": model_dir, "kv_dtype": args.kv_dtype, "control": args.control,
               "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "mean_agreement": mean,
               "exact": n_exact, "rows": rows}
        if args.json == "-":
            print(json.dumps(doc, indent=1))
        else:
            Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1
