"""Needle-in-a-haystack grid per kv-dtype x context x depth (DESIGN §7).

Five needles at 10/25/50/75/90% depth in one document (ninfer.tools.probe.data), the question asked at
the very end, each needle asked and scored on its own: five requests per context, greedy, prefix
reuse off. A needle passes when the output is exactly the answer sentence "The secret code for
<key> is <value>." and finish_reason == "stop".
The margin is the smallest log-odds log(p/(1-p)) of the answer tokens as generated (from the
chosen tokens' logprobs): positive and growing while every token is right, so it moves where
pass/fail saturates; at the first wrong token it is -|log-odds of the wrong token|, an upper
bound on the right token's log-odds (which had at most min(p, 1-p)).

In-process through `ninfer.LLM`, or against a running ninfer-serve / OpenAI-compatible server
with --server URL (/v1/completions with the chat-formatted prompt, or --chat for
/v1/chat/completions; start the server with prefix reuse off).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ninfer.config import PAGE_SIZE, _positive_int, parse_token_count
from ninfer.tools.probe import data, default_model_dir
from ninfer.tools.probe.evaluate import encoder, log_odds_from_logprob

MAX_TOKENS = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: the bundled probe model)")
    p.add_argument("--contexts", default="4K", help="comma-separated context sizes, e.g. 4K,16K,64K")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="bf16,int8,rk4v4-e8",
                   help="comma-separated KV formats (in-process) (default %(default)s)")
    p.add_argument("--server", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--chat", action="store_true", help="with --server: use /v1/chat/completions")
    p.add_argument("--served-model", default=None, help="with --server: the model name to send")
    p.add_argument("--device", default="auto")
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=_positive_int, default=1, metavar="N",
                   help="in-process: shard the model over N ranks (default 1)")
    p.add_argument("--docs", type=int, default=1, help="documents per context (5 needles each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH (or stdout)")


def score(gold_ids: list[int], out_ids: list[int], logprobs: list[float] | None) -> float | None:
    """Signed margin of a generated answer against the gold tokens (see the module doc)."""
    if not logprobs:
        return None
    m = float("inf")
    for i, lp in enumerate(logprobs[:len(gold_ids)]):
        lo = log_odds_from_logprob(lp)
        if i < len(out_ids) and out_ids[i] == gold_ids[i]:
            m = min(m, lo)
        else:
            # greedy picked a wrong token with prob p, so the right one has at most min(p, 1-p)
            return round(min(m, -abs(lo)), 3)
    return round(m, 3) if m != float("inf") else None


def build_cases(tokenizer, context: int, docs: int, seed: int) -> list[dict]:
    tokenize = encoder(tokenizer)
    cases = []
    for d in range(docs):
        hay = data.bench_haystack(context, seed * 100003 + context * 7 + d, tokenize)
        for n in hay.needles:
            cases.append({"context": context, "doc": d, "depth": n.depth, "key": n.key, "value": n.value,
                          "prompt": data.chat_prompt(hay.text, n.key),
                          "user": hay.text + "\n\n" + data.question_text(n.key),
                          "answer": data.answer_text(n.key, n.value),
                          "gold_ids": tokenize([data.answer_text(n.key, n.value) + data.END])[0]})
    return cases


def _finish(case: dict, text: str, finish: str | None, out_ids, logprobs, prompt_tokens, cached=None) -> dict:
    ok = text.strip() == case["answer"] and finish == "stop"
    row = {k: case[k] for k in ("context", "doc", "depth", "key", "value")}
    row.update(text=text, finish_reason=finish, passed=ok, prompt_tokens=prompt_tokens,
               margin=score(case["gold_ids"], out_ids, logprobs))
    if cached is not None:
        row["cached_tokens"] = cached
    return row


def run_inprocess(model_dir: str, kv_dtype: str, contexts: list[int], docs: int, seed: int, device: str,
                  prefix_reuse: bool | None = None, bar: Any = None, tensor_parallel_size: int = 1) -> list[dict]:
    """DESIGN §7: prefix reuse off (every question prefills its whole document). With
    `prefix_reuse` (the default on CPU, where each 4K prefill costs seconds) each document's first
    question runs alone, so its pages are cached, and the other four reuse them: the scores are the
    same, since cached pages hold exactly the K/V (in the stored format) a recomputation would store.
    `bar` (a tqdm) advances by one per answered question."""
    from ninfer import LLM, SamplingParams
    from ninfer.engine.cpu import resolve_device
    if prefix_reuse is None:
        prefix_reuse = resolve_device(device).type == "cpu"
    per_doc = len(data.BENCH_DEPTHS)
    # The pool holds what runs at once: one document's questions (at most `per_doc` sequences).
    llm = LLM(model_dir, kv_dtype=kv_dtype, device=device, max_context=max(contexts),
              enable_prefix_caching=prefix_reuse, max_num_seqs=per_doc, tensor_parallel_size=tensor_parallel_size,
              kv_capacity=-(-max(contexts) // PAGE_SIZE) * PAGE_SIZE * per_doc)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    rows = []

    def generate(prompts: list[str]) -> list:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if bar is not None:
            bar.update(len(outs))
        return outs

    for ctx in contexts:
        if bar is not None:
            bar.set_postfix_str(f"{kv_dtype} {ctx} tokens", refresh=True)
        cases = build_cases(tok, ctx, docs, seed)
        outs = []
        for d in range(docs):
            doc = [c["prompt"] for c in cases if c["doc"] == d]
            outs += generate(doc[:1]) + generate(doc[1:]) if prefix_reuse else generate(doc)
        for c, o in zip(cases, outs):
            rows.append(_finish(c, o.text, o.finish_reason, list(o.token_ids), o.logprobs,
                                len(o.prompt_token_ids), getattr(o, "num_cached_tokens", None)))
    llm.close()
    return rows


def run_server(url: str, model_dir: str, contexts: list[int], docs: int, seed: int, chat: bool,
               served: str | None) -> list[dict]:
    import httpx
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    url = url.rstrip("/")
    with httpx.Client(timeout=600) as cli:
        name = served or cli.get(url + "/v1/models").json()["data"][0]["id"]
        rows = []
        for ctx in contexts:
            for c in build_cases(tok, ctx, docs, seed):
                body = {"model": name, "temperature": 0, "max_tokens": MAX_TOKENS}
                if chat:
                    body.update(messages=[{"role": "user", "content": c["user"]}], logprobs=True)
                    r = cli.post(url + "/v1/chat/completions", json=body).json()
                    ch = r["choices"][0]
                    text = ch["message"]["content"] or ""
                    lps = [t["logprob"] for t in ((ch.get("logprobs") or {}).get("content") or [])]
                else:
                    body.update(prompt=c["prompt"], logprobs=1)
                    r = cli.post(url + "/v1/completions", json=body).json()
                    ch = r["choices"][0]
                    text = ch["text"]
                    lps = (ch.get("logprobs") or {}).get("token_logprobs") or []
                usage = r.get("usage") or {}
                out_ids = tok(text, add_special_tokens=False)["input_ids"]
                if ch.get("finish_reason") == "stop":
                    out_ids = out_ids + [tok.eos_token_id]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                rows.append(_finish(c, text, ch.get("finish_reason"), out_ids, lps or None,
                                    usage.get("prompt_tokens"), cached))
    return rows


def command_line(args: argparse.Namespace) -> str:
    """The equivalent command line (also when called as a function, not from a shell)."""
    parts = ["ninfer bench needle"] + ([args.model] if args.model else [])
    parts += [f"--contexts {args.contexts}", f"--device {args.device}", f"--docs {args.docs}", f"--seed {args.seed}"]
    parts += [f"-tp {args.tensor_parallel_size}"] if getattr(args, "tensor_parallel_size", 1) != 1 else []
    parts += [f"--server {args.server}"] + (["--chat"] if args.chat else []) if args.server else [f"--kv-dtype {args.kv_dtype}"]
    return " ".join(parts + ([f"--json {args.json}"] if args.json else []))


def table(results: dict[str, list[dict]]) -> str:
    depths = [f"{d:.0%}" for d in data.BENCH_DEPTHS]
    lines = [f"{'kv-dtype':<10} {'context':>8} " + " ".join(f"{d:>10}" for d in depths) + "   pass  min margin"]
    for kv, rows in results.items():
        for ctx in sorted({r["context"] for r in rows}):
            rs = [r for r in rows if r["context"] == ctx]
            cells = []
            for d in data.BENCH_DEPTHS:
                sub = [r for r in rs if abs(r["depth"] - d) < 1e-9]
                ok = sum(r["passed"] for r in sub)
                ms = [r["margin"] for r in sub if r["margin"] is not None]
                mark = ("ok" if ok == len(sub) else f"{ok}/{len(sub)}") + (f" {min(ms):+.1f}" if ms else "")
                cells.append(f"{mark:>10}")
            ms = [r["margin"] for r in rs if r["margin"] is not None]
            lines.append(f"{kv:<10} {ctx:>8} " + " ".join(cells) +
                         f"  {sum(r['passed'] for r in rs):>2}/{len(rs):<2}  " + (f"{min(ms):+.2f}" if ms else "-"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ninfer.checkpoints import resolve_model
    try:
        model_dir = str(resolve_model(args.model) if args.model else default_model_dir())
    except ValueError as e:
        raise SystemExit(f"ninfer bench needle: {e}")
    contexts = [parse_token_count(x) for x in args.contexts.split(",") if x.strip()]
    kvs = [x.strip() for x in args.kv_dtype.split(",") if x.strip()]
    results: dict[str, list[dict]] = {}
    t0 = time.time()
    if args.server:
        results["server"] = run_server(args.server, model_dir, contexts, args.docs, args.seed, args.chat,
                                       args.served_model)
    else:
        from tqdm.auto import tqdm
        with tqdm(total=len(kvs) * len(contexts) * args.docs * len(data.BENCH_DEPTHS), desc="needle",
                  unit="question", dynamic_ncols=True) as bar:
            for kv in kvs:
                results[kv] = run_inprocess(model_dir, kv, contexts, args.docs, args.seed, args.device, bar=bar,
                                            tensor_parallel_size=args.tensor_parallel_size)
    print(table(results))
    n = sum(len(v) for v in results.values())
    passed = sum(r["passed"] for v in results.values() for r in v)
    print(f"needle: {passed}/{n} passed in {time.time() - t0:.1f}s (model {model_dir})")
    if args.json:
        doc = {"bench": "needle", "model": model_dir, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
               "command": command_line(args),
               "server": args.server, "seconds": round(time.time() - t0, 1), "results": results}
        if args.json == "-":
            print(json.dumps(doc, indent=1))
        else:
            Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0  # a completed run is a result, whatever it scored; the score is in the table and JSON
