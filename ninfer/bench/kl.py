"""Next-token KL divergence of each KV format against a reference KV format (`ninfer bench kl`).

The reference (default bf16) answers the needle bench's prompts greedily; every other kv-dtype is
then teacher-forced along the reference's tokens through the whole engine (prefill and decode read
the stored, quantized cache), so each step compares the two next-token distributions after the
same history. Reported per kv-dtype and context: mean and max KL(ref || fmt) in nats over the
answer tokens, and greedy top-1 agreement. The same runner backs tests/test_engine_kl.py.

    ninfer bench kl [MODEL] [--kv-dtype int8,rk4v4,rk4v4-e8] [--reference bf16] [--contexts 4K]

``--text`` scores every position of the shipped English passages instead (``kv_sim.py``: K/V
quantized inside transformers, per kv-dtype, K only / V only, per layer; ``rk4v4-e8:refit``
is the candidate scale-refit encoder beside the shipped one, so both compare in one run; ``v2:*``
are the candidate codecs of ``kv_sim_v2.py``). A
``+c`` suffix stores keys centred and smoothed as the engine does (``kvcache/centering.py``,
calibrated on its passage, which is then not scored), ``+m`` centred only:

    ninfer bench kl MODEL --text --kv-dtype int8,rk4v4-e8,rk4v4-e8+c --planes kv,k,v [--per-layer]

The engine's own runs (without ``--text``) use its default, centring on for quantized formats;
``--no-kv-centering`` turns it off there.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from tqdm.auto import tqdm

MAX_TOKENS = 16  # the probe's answer is 12-13 tokens incl. the end token


def teacher_forced(llm, prompts: list, max_tokens: int, forced: list[list[int]] | None
                   ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation of `max_tokens` per prompt (EOS ignored); with `forced`, request i follows
    forced[i] instead. Returns the tokens and the float32 logits [steps, V] of every step."""
    from ninfer import SamplingParams
    rows: dict[str, list[torch.Tensor]] = {}
    index: dict[str, int] = {}

    def hook(reqs, logits: torch.Tensor) -> None:
        for j, r in enumerate(reqs):
            rows.setdefault(r.request_id, []).append(logits[j].float().cpu().clone())
            if forced is not None:
                logits[j] = -1e30  # finite: non-finite rows are finished as errors
                logits[j, forced[index[r.request_id]][r.num_output_tokens]] = 0.0

    llm.engine.logits_hook = hook
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        for i, p in enumerate(prompts):
            index[f"kl-{i}"] = i
            llm.engine.add_request(f"kl-{i}", p, params)
        done: dict[str, list[int]] = {}
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
    finally:
        llm.engine.logits_hook = None
    ids = [f"kl-{i}" for i in range(len(prompts))]
    return [done[r] for r in ids], [torch.stack(rows[r]) for r in ids]


def compare(ref_logits: list[torch.Tensor], logits: list[torch.Tensor]) -> dict[str, float]:
    """Mean / max KL(ref || fmt) in nats over every step, and greedy top-1 agreement."""
    ref_lp = torch.log_softmax(torch.cat(ref_logits).double(), -1)
    lp = torch.log_softmax(torch.cat(logits).double(), -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0)
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top1": float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()), "n": int(kl.numel())}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: the bundled probe model)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="int8,rk4v4,rk4v4-e8",
                   help="comma-separated KV formats to compare (default %(default)s; with --text also "
                        "rk4v4-e8:refit, the v2:* candidates of bench/kv_sim_v2.py and a +c / +m suffix: keys centred)")
    p.add_argument("--reference", default="bf16", help="reference KV format (default %(default)s)")
    p.add_argument("--contexts", default="4K", help="comma-separated context sizes (needle bench documents)")
    p.add_argument("--docs", type=int, default=1, help="documents per context, 5 questions each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    p.add_argument("--no-kv-centering", dest="kv_centering", action="store_const", const=False, default=None,
                   help="engine runs: store keys as they are (default: centred for quantized formats)")
    p.add_argument("--text", action="store_true", help="KL at every position of the shipped passages")
    p.add_argument("--planes", default="kv", help="with --text: quantized planes, comma-separated kv, k, v")
    p.add_argument("--tokens", type=int, default=384, help="with --text: tokens per passage (default %(default)s)")
    p.add_argument("--per-layer", action="store_true", help="with --text: also one layer quantized at a time")
    p.add_argument("--engine", action="store_true", help="with --text: through the engine (prompt, then forced "
                   "decode steps scored), engine kv-dtypes only (bench/kl_engine_text.py)")
    p.add_argument("--join", action="store_true", help="with --text --engine: every rotation of the held-out "
                   "passages joined into one document (prompts longer than a passage)")
    p.add_argument("--scored", type=int, default=128, help="with --text --engine: decode steps scored per passage "
                   "(default %(default)s)")


def _run_text(args: argparse.Namespace, model: str) -> int:
    from ninfer.bench import kl_engine_text, kv_sim
    args.model = model
    try:
        res = kl_engine_text.run(args, model) if args.engine else kv_sim.run_text(args)
    except ValueError as e:
        raise SystemExit(f"ninfer bench kl: {e}")
    res["command"] = "ninfer bench kl " + " ".join(sys.argv[3:])
    res["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    print(kl_engine_text.table(res) if args.engine else kv_sim.text_table(res))
    if args.json:
        text = json.dumps(res, indent=1)
        print(text) if args.json == "-" else open(args.json, "w").write(text)
    return 0


def run(args: argparse.Namespace) -> int:
    from ninfer import LLM
    from ninfer.bench import _timing as T
    from ninfer.bench.needle import build_cases
    from ninfer.tools.probe import default_model_dir
    from ninfer.checkpoints import resolve_model
    model = args.model or str(default_model_dir())
    try:  # a directory, a .gguf file or an alias such as smollm2
        model = str(resolve_model(model))
    except ValueError as e:
        raise SystemExit(f"ninfer bench kl: {e}")
    if args.join and not args.engine or args.engine and not args.text:
        raise SystemExit("ninfer bench kl: --join needs --engine, and --engine needs --text")
    if args.text:
        return _run_text(args, model)
    try:  # bad input fails here, before any model is loaded
        kvs = T.kv_dtypes(args.kv_dtype)
        T.kv_dtypes(args.reference)
        contexts = T.token_counts(args.contexts)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise SystemExit(f"ninfer bench kl: {e}")
    if not contexts or args.docs < 1:
        raise SystemExit("ninfer bench kl: give at least one context and --docs >= 1")
    t0 = time.time()
    results: dict[str, dict[str, dict]] = {k: {} for k in kvs}
    ref_answers: dict[int, list[str]] = {}

    def engine(kv: str):
        return LLM(model, kv_dtype=kv, device=args.device, max_context=max(contexts) + MAX_TOKENS,
                   enable_prefix_caching=False, kv_centering=args.kv_centering)

    bar = tqdm(total=(1 + len(kvs)) * len(contexts), desc="kl", unit="run", dynamic_ncols=True)
    bar.set_postfix_str(f"{args.reference} (reference)")
    llm = engine(args.reference)
    tok = llm.engine.tokenizer
    cases = {c: build_cases(tok, c, args.docs, args.seed) for c in contexts}
    ref = {}
    for c in contexts:
        ref[c] = teacher_forced(llm, [x["prompt"] for x in cases[c]], MAX_TOKENS, None)
        ref_answers[c] = [tok.decode(t) for t in ref[c][0]]
        bar.update(1)
    del llm
    for kv in kvs:
        bar.set_postfix_str(kv)
        llm = engine(kv)
        for c in contexts:
            _, logits = teacher_forced(llm, [x["prompt"] for x in cases[c]], MAX_TOKENS, ref[c][0])
            results[kv][str(c)] = compare(ref[c][1], logits)
            bar.update(1)
        del llm
    bar.close()
    lines = [f"next-token KL vs {args.reference} KV, teacher-forced along its greedy answers "
             f"({MAX_TOKENS} tokens x {5 * args.docs} questions per context)",
             "| kv-dtype | context | mean KL (nats) | max KL | top-1 agreement |", "|---|---|---|---|---|"]
    for kv in kvs:
        for c, r in results[kv].items():
            lines.append(f"| {kv} | {c} | {r['mean_kl']:.3e} | {r['max_kl']:.3e} | {r['top1']:.3f} |")
    print("\n".join(lines))
    out = {"bench": "kl", "model": model, "reference": args.reference, "max_tokens": MAX_TOKENS,
           "docs": args.docs, "seed": args.seed, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
           "command": "ninfer bench kl " + " ".join(sys.argv[3:]), "seconds": round(time.time() - t0, 1),
           "reference_answers": {str(c): a for c, a in ref_answers.items()}, "results": results}
    if args.json == "-":
        print(json.dumps(out, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
