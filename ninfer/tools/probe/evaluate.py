"""Reference retrieval evaluation of a probe checkpoint with transformers (no ninfer engine).

For each context length: documents from `data.bench_haystack` (needles at 10/25/50/75/90%
depth), each needle asked on its own with the full chat prompt tokenized as a whole (exactly
what a server would see). The shared document prefix is prefilled once and the cache cropped
back after each question. Scoring is teacher-forced on the answer sentence "The secret code for
<key> is <value>.<|end|>": it is exact
iff every answer token is the argmax (which is what greedy decoding would produce, end token
included, i.e. finish_reason "stop"); the margin is the smallest log-odds log(p/(1-p)) over the
answer tokens, which keeps moving where pass/fail saturates.
"""
from __future__ import annotations

import math
import time

import torch

from . import data


def encoder(tok):
    """tokenize(list[str]) -> list[list[int]] for a `tokenizers.Tokenizer` or an HF fast tokenizer."""
    raw = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None) or tok
    return lambda xs: [e.ids for e in raw.encode_batch(list(xs), add_special_tokens=False)]


def log_odds(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log p(target) - log(1 - p(target)) per row, computed without cancellation."""
    logits = logits.float()
    gold = logits.gather(-1, target[:, None])[:, 0]
    others = logits.scatter(-1, target[:, None], float("-inf"))
    return gold - torch.logsumexp(others, dim=-1)


def log_odds_from_logprob(lp: float) -> float:
    """The same margin from the chosen token's logprob alone (what an engine returns)."""
    if lp >= -1e-12:
        return 30.0
    return lp - math.log(-math.expm1(lp))


@torch.no_grad()
def eval_document(model, tokenize, hay: data.Haystack, device) -> list[dict]:
    from transformers import DynamicCache
    prompts = [tokenize([data.chat_prompt(hay.text, n.key)])[0] for n in hay.needles]
    answers = [tokenize([data.answer_text(n.key, n.value) + data.END])[0] for n in hay.needles]
    p = 0  # common prefix of all prompts
    while all(len(x) > p for x in prompts) and len({x[p] for x in prompts}) == 1:
        p += 1
    p -= 1  # keep one token of suffix so every question has input
    cache = DynamicCache(config=model.config)
    pre = torch.tensor([prompts[0][:p]], device=device)
    model(input_ids=pre, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = []
    for n, ids, ans in zip(hay.needles, prompts, answers):
        seq = ids[p:] + ans[:-1]
        pos = torch.arange(p, p + len(seq), device=device)[None]
        logits = model(input_ids=torch.tensor([seq], device=device), position_ids=pos,
                       past_key_values=cache, use_cache=True).logits[0]
        logits = logits[len(ids) - p - 1:]  # positions predicting each answer token
        target = torch.tensor(ans, device=device)
        ok = bool((logits.argmax(-1) == target).all())
        margin = float(log_odds(logits, target).min())
        out.append({"depth": n.depth, "key": n.key, "value": n.value, "exact": ok,
                    "margin": round(margin, 3), "prompt_tokens": len(ids)})
        cache.crop(p - cache.get_seq_length())  # drop this question's tokens
    return out


def evaluate(model, tok, lengths, docs_per_length: int = 4, seed: int = 12345, device="cpu",
             deadline: float | None = None, log=print) -> dict:
    """{length: {"exact": frac, "by_depth": {...}, "mean_margin": ..., "n": ...}}; lengths past
    the wall-clock `deadline` are skipped (and reported as such)."""
    tokenize = encoder(tok)
    model.eval()
    res = {}
    for L in lengths:
        if deadline is not None and time.time() > deadline:
            res[str(L)] = {"skipped": "out of time"}
            continue
        t0 = time.time()
        rows = []
        for d in range(docs_per_length):
            hay = data.bench_haystack(L, seed * 7919 + L * 31 + d, tokenize)
            rows += eval_document(model, tokenize, hay, device)
        by_depth = {}
        for r in rows:
            by_depth.setdefault(f"{r['depth']:.2f}", []).append(r["exact"])
        res[str(L)] = {
            "exact": sum(r["exact"] for r in rows) / len(rows), "n": len(rows),
            "by_depth": {k: sum(v) / len(v) for k, v in by_depth.items()},
            "mean_margin": round(sum(r["margin"] for r in rows) / len(rows), 3),
            "min_margin": min(r["margin"] for r in rows),
            "seconds": round(time.time() - t0, 1)}
        log(f"eval L={L}: exact {res[str(L)]['exact']:.3f} ({len(rows)} q) margin "
            f"{res[str(L)]['mean_margin']:+.2f} by depth {res[str(L)]['by_depth']}")
    return res


def load(model_dir, device="cpu", dtype=torch.float32, rope_parameters: dict | None = None):
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    if rope_parameters is not None:
        cfg.rope_parameters = rope_parameters
    model = Qwen3ForCausalLM.from_pretrained(model_dir, config=cfg, dtype=dtype,
                                             attn_implementation="sdpa").to(device)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)
