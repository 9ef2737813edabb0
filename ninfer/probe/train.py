"""Train the bundled probe model (a small Qwen3) on synthetic long-document retrieval.

    python -m ninfer.probe.train --out DIR [--minutes M] [--seed S] [--device cuda] [--tiny]

Recipe (why each piece is there):
* Every needle of a document is asked at the end, as a multi-turn chat, with the loss on all
  answers (dense supervision); filler and questions get a small LM loss so the model also
  writes text-like output.
* The answer repeats the needle sentence; keys are single tokens and " is NN" + "NN" the value
  (tokenizer.py), so retrieval is two induction steps: after the key, copy what followed the
  same key in the document; after " is NN", copy what followed it (unique per document).
* Needle density: a document of L tokens holds 2 to n = min(--max-needles, L / --needle-tokens)
  needles, all asked (--min-needles-frac raises the floor to frac x n). Copying any needle's value
  scores 1/n, a plateau both 2026-11-29 GPU runs stayed on (2-4 needles per document, ~1K steps);
  denser documents make it pay less, but the only CPU-scale run that went past copy-any within
  ~1500 steps had 2-4 needles (docs/BENCHMARKS.md, Probe model), so the floor stays at 2.
* Many small steps (8K tokens/step): --hold of the run on --min-len documents (almost only
  needles and questions, plain positions, clean K/V: where key matching forms), then a length
  curriculum to --max-len, later batches mixing all lengths. AdamW, weight decay 0.1, 100-step
  warmup, cosine to 0.1x, grad clip 1.0.
* Position gaps (after --hold): with probability 1/2 a document's positions jump at a few filler sentence
  boundaries (total up to --gap-mult x its length) plus a random offset, so relative distances
  far beyond the trained length are seen while every sentence stays contiguous.
* K/V noise (after --hold): on half of the steps Gaussian noise of --kv-noise x RMS is added to keys (after
  k_norm) and values, the size of the rk4v4-e8 codec's error (~9%), so 4-bit KV keeps answers.
The run stops itself by wall clock, evaluates exact retrieval on held-out documents at several
lengths (greedy, transformers, the bf16 weights as shipped; plain RoPE and YaRN), writes the HF
directory and a JSON report.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import data
from .evaluate import encoder, evaluate
from .tokenizer import VOCAB_SIZE, build_tokenizer, special_ids, wrap

# 6 Q heads per KV head, head_dim 256 (the issue's shape). "full": 12 Q / 2 KV (run 1's shape, the
# one that at least learned to copy); "narrow": 6 Q / 1 KV, half the attention FLOPs of a 4K CPU
# request, wider MLP.
FULL = dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2,
            head_dim=256, intermediate_size=512)
NARROW = dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=1,
              head_dim=256, intermediate_size=1024)
DEEP = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=1,
            head_dim=256, intermediate_size=768)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=128)

_TOK = None


def _init_worker(tok_json: str) -> None:
    global _TOK
    from tokenizers import Tokenizer
    _TOK = Tokenizer.from_str(tok_json)
    torch.set_num_threads(1)


def make_batch(job: tuple) -> tuple:
    """One batch of about `tokens` tokens of length-L documents: (ids, positions, loss weights,
    answer ids: a distinct number for every answer's tokens, 0 elsewhere)."""
    L, tokens, seed, gap_mult, lm_weight, max_needles, repeat, needle_tokens, lo_frac = job
    enc = encoder(_TOK)
    rng = random.Random(seed)
    head = enc([data.USER + "\n"])[0]
    rows = []
    for _ in range(max(1, tokens // L)):
        # Many needles per document (MQAR-style): with n needles, copying an arbitrary one
        # scores only 1/n, so the key-matching circuit is what the gradient pays for; with 2-4
        # needles the copy-any shortcut (1/2 to 1/4) is a plateau the GPU runs never left.
        hi = max(2, min(max_needles, L // needle_tokens))
        n = rng.randint(max(2, int(hi * lo_frac)), hi)
        hay = data.make_haystack(rng, L - 26 * n - 4, n, tokenize=enc, repeat=repeat)
        segs = data.training_turns(hay, rng)
        seg_ids = enc([s for s, _ in segs])
        ids = head + [t for p in hay.piece_ids for t in p]
        w = [lm_weight] * len(ids)
        starts = {}
        acc = len(head)
        rep = set(hay.repeats)
        for i, p in enumerate(hay.piece_ids):
            starts[i] = acc
            if i in rep:  # copied sentences: predictable from the 3rd token on, full weight
                w[acc + 2:acc + len(p)] = [1.0] * max(0, len(p) - 2)
            acc += len(p)
        sg = [0] * len(ids)
        for j, ((_, tgt), t) in enumerate(zip(segs, seg_ids)):
            ids += t
            w += [1.0 if tgt else lm_weight] * len(t)
            sg += [len(rows) * 1000 + j + 1 if tgt else 0] * len(t)
        pos = np.arange(len(ids))
        if gap_mult > 0 and rng.random() < 0.5:
            total = int(rng.random() * gap_mult * len(ids))
            cuts = rng.sample(hay.gaps, min(len(hay.gaps), rng.randint(1, 8)))
            shares = [rng.random() for _ in cuts]
            jump = np.zeros(len(ids), dtype=np.int64)
            jump[0] = rng.randrange(4096)
            for c, s in zip(cuts, shares):
                jump[starts[c]] += int(total * s / sum(shares))
            pos = pos + np.cumsum(jump)
        rows.append((ids, pos, w, sg))
    T = max(len(r[0]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    pos = torch.zeros(len(rows), T, dtype=torch.long)
    wts = torch.zeros(len(rows), T)
    seg = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (a, p, w, sg) in enumerate(rows):
        ids[i, :len(a)] = torch.from_numpy(np.asarray(a, dtype=np.int64))
        pos[i, :len(a)] = torch.from_numpy(p)
        pos[i, len(a):] = torch.arange(int(p[-1]) + 1, int(p[-1]) + 1 + T - len(a))
        wts[i, :len(a)] = torch.from_numpy(np.asarray(w, dtype=np.float32))
        seg[i, :len(a)] = torch.from_numpy(np.asarray(sg, dtype=np.int64))
    return ids, pos, wts, seg


def schedule(progress: float, max_len: int, rng: random.Random, min_len: int = 128, hold: float = 0.25,
             grow_until: float = 0.75) -> int:
    """Curriculum: min_len-token documents (many needles per token: where key matching is
    learned) until `hold` of the run, then the length cap grows geometrically to max_len by
    `grow_until`; each batch's length is log-uniform between min_len and the cap (x64)."""
    lo = min(min_len, max_len)
    cap = lo * (max_len / lo) ** min(1.0, max(0.0, (progress - hold) / (grow_until - hold)))
    L = math.exp(rng.uniform(math.log(lo), math.log(cap)))
    return max(lo, int(L) // 64 * 64)


def _noise_hooks(model, level: float, active: list[bool]) -> None:
    def hook(_mod, _inp, out):
        if not active[0] or level <= 0:
            return out
        rms = out.float().pow(2).mean(-1, keepdim=True).sqrt()
        return out + (torch.randn_like(out, dtype=torch.float32) * rms * level).to(out.dtype)
    for layer in model.model.layers:
        layer.self_attn.k_norm.register_forward_hook(hook)
        layer.self_attn.v_proj.register_forward_hook(hook)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ninfer.probe.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output HF model directory")
    ap.add_argument("--report", help="training report JSON (default: <out>_train.json beside the directory)")
    ap.add_argument("--minutes", type=float, default=4.8, help="wall-clock training budget")
    ap.add_argument("--eval-minutes", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model, documents of <= 256 tokens, 4096 tokens/step (CPU smoke test)")
    ap.add_argument("--shape", choices=["full", "narrow", "deep"], default="narrow",
                    help="full: 4 layers, 12 Q / 2 KV heads; narrow: 4 layers, 6 Q / 1 KV; deep: 6 layers, 6 Q / 1 KV")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--batch-tokens", type=int, default=8192,
                    help="tokens per step; small steps: key matching needs many updates, not big batches")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--gap-mult", type=float, default=15.0,
                    help="position gaps up to this x the document length: 4096 x 16 spans the 64K grid point")
    ap.add_argument("--kv-noise", type=float, default=0.1)
    ap.add_argument("--lm-weight", type=float, default=0.02)
    ap.add_argument("--repeat", type=float, default=0.0,
                    help="fraction of filler sentences that copy an earlier one (induction signal)")
    ap.add_argument("--min-len", type=int, default=384)
    ap.add_argument("--hold", type=float, default=0.35,
                    help="fraction of the run at --min-len, needle-dense, no position gaps, no K/V noise")
    ap.add_argument("--grow-until", type=float, default=0.75, help="fraction of the run where --max-len is reached")
    ap.add_argument("--needle-tokens", type=int, default=36,
                    help="at most one needle per this many tokens (a needle + its Q/A turn is ~36: no filler at the limit)")
    ap.add_argument("--max-needles", type=int, default=32)
    ap.add_argument("--min-needles-frac", type=float, default=0.0,
                    help="needles per document are uniform in [max(2, frac x n), n]; 0 keeps 2-needle documents")
    ap.add_argument("--workers", type=int, default=min(12, (os.cpu_count() or 2) - 1))
    ap.add_argument("--eval-lengths", default="1024,4096,16384,32768,65536")
    ap.add_argument("--eval-docs", type=int, default=4)
    a = ap.parse_args(argv)
    if a.tiny:
        a.max_len, a.batch_tokens = min(a.max_len, 256), min(a.batch_tokens, 4096)
        a.eval_lengths = a.eval_lengths if "--eval-lengths" in (argv or sys.argv) else "256,512"
    t_start = time.time()
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        log_lines.append(line)

    torch.manual_seed(a.seed)
    if a.device == "cpu":  # on a shared CPU, intra-op threads mostly spin-wait
        torch.set_num_threads(1)
    tok = build_tokenizer(seed=a.seed)
    sp = special_ids(tok)
    log(f"tokenizer: {tok.get_vocab_size()} tokens")
    pool = None
    if a.workers > 0:  # fork before CUDA is touched
        import multiprocessing as mp
        pool = mp.get_context("fork").Pool(a.workers, _init_worker, (tok.to_str(),))
    else:
        _init_worker(tok.to_str())

    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    shape = TINY if a.tiny else {"full": FULL, "narrow": NARROW, "deep": DEEP}[a.shape]
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, max_position_embeddings=65536, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      bos_token_id=None, eos_token_id=sp[data.END], pad_token_id=sp[data.PAD],
                      attn_implementation="sdpa", **shape)
    dev = torch.device(a.device)
    model = Qwen3ForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M params {shape} on {dev}")
    noise_on = [False]
    _noise_hooks(model, a.kv_noise, noise_on)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.type == "cuda")
    budget = a.minutes * 60
    sched_rng = random.Random(a.seed)
    t0 = time.time()

    def job(step: int) -> tuple:
        L = schedule((time.time() - t0) / budget, a.max_len, sched_rng, a.min_len, a.hold, a.grow_until)
        # key matching first (plain positions, clean K/V), then robustness to gaps and KV noise
        late = (time.time() - t0) / budget >= a.hold
        return (L, a.batch_tokens, a.seed * 1_000_003 + step, a.gap_mult if late else 0.0, a.lm_weight, a.max_needles, a.repeat,
                a.needle_tokens, a.min_needles_frac)

    pending = [pool.apply_async(make_batch, (job(i),)) for i in range(2 * a.workers)] if pool else []
    step, n_tok, last_log, hist = 0, 0, t0, []
    agg = {"loss": 0.0, "acc": 0.0, "exact": 0.0, "n": 0}
    while time.time() - t0 < budget:
        if pool:
            ids, pos, wts, seg = pending.pop(0).get()
            pending.append(pool.apply_async(make_batch, (job(step + len(pending) + 1),)))
        else:
            ids, pos, wts, seg = make_batch(job(step))
        ids, pos, wts = ids.to(dev, non_blocking=True), pos.to(dev), wts.to(dev)
        progress = (time.time() - t0) / budget
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        noise_on[0] = step % 2 == 1 and progress >= a.hold
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            # an explicit all-ones mask stops transformers from reading position gaps as packing
            logits = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits
        logits = logits[:, :-1].float()
        tgt, w = ids[:, 1:], wts[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                reduction="none").view_as(w)
        loss = (nll * w).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        n_tok += ids.numel()
        with torch.no_grad():  # an answer is exact when all its tokens are the argmax
            sg = seg[:, 1:].to(dev)
            ans = sg > 0
            correct = (logits.argmax(-1) == tgt)[ans]
            wrong = torch.zeros(int(sg.max()) + 1, device=dev).index_add_(0, sg[ans], (~correct).float())
            present = torch.zeros_like(wrong).index_add_(0, sg[ans], torch.ones_like(wrong[sg[ans]]))
            agg["loss"] += float(nll[ans].mean()); agg["acc"] += float(correct.float().mean())
            agg["exact"] += float((wrong[present > 0] == 0).float().mean()); agg["n"] += 1
        if time.time() - last_log > (5 if a.tiny else 15):
            el = time.time() - t0
            m = {k: agg[k] / agg["n"] for k in ("loss", "acc", "exact")}
            hist.append({"step": step, "s": round(el, 1), "L": ids.shape[1], "lr": lr, **{k: round(v, 4) for k, v in m.items()}})
            log(f"step {step} L={ids.shape[1]}x{ids.shape[0]} lr {lr:.2e} answer loss {m['loss']:.3f} "
                f"token acc {m['acc']:.3f} answer exact {m['exact']:.3f} | {n_tok / el / 1e3:.0f}K tok/s")
            agg = {"loss": 0.0, "acc": 0.0, "exact": 0.0, "n": 0}
            last_log = time.time()
    train_s = time.time() - t0
    if pool:
        pool.terminate()
    log(f"trained {step} steps, {n_tok / 1e6:.1f}M tokens in {train_s:.0f}s")

    # Save as shipped (bf16 weights), then evaluate exactly that.
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, max_shard_size="15MB", safe_serialization=True)
    fast = wrap(tok)
    fast.save_pretrained(out, save_jinja_files=False)
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)
    GenerationConfig(eos_token_id=sp[data.END], pad_token_id=sp[data.PAD], do_sample=False,
                     max_new_tokens=16).save_pretrained(out)
    files = sorted(p.name for p in out.iterdir())
    log(f"saved {out}: {files}")

    lengths = [int(x) for x in a.eval_lengths.split(",")]
    deadline = time.time() + a.eval_minutes * 60
    ev_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = model.to(ev_dtype)
    results = {"rope_default": evaluate(model, tok, lengths, a.eval_docs, seed=a.seed + 1, device=dev,
                                        deadline=deadline, log=log)}
    if lengths[-1] > a.max_len and time.time() < deadline:  # YaRN: same weights, interpolated low frequencies
        factor = lengths[-1] / a.max_len
        rp = {"rope_type": "yarn", "rope_theta": 1e6, "factor": factor,
              "original_max_position_embeddings": a.max_len}
        ycfg = Qwen3Config(**{**model.config.to_dict(), "rope_parameters": rp,
                              "max_position_embeddings": int(lengths[-1])})
        ymodel = Qwen3ForCausalLM(ycfg).to(dev, ev_dtype)
        ymodel.load_state_dict(model.state_dict())
        log(f"YaRN eval {rp}")
        results["yarn"] = {"rope_parameters": rp, **evaluate(ymodel, tok, lengths, a.eval_docs, seed=a.seed + 1,
                                                              device=dev, deadline=deadline, log=log)}
    report = {
        "command": "python -m ninfer.probe.train " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "args": vars(a), "params": n_params, "config": shape,
        "train_seconds": round(train_s, 1), "steps": step, "train_tokens": n_tok,
        "total_seconds": round(time.time() - t_start, 1), "files": files,
        "history": hist, "eval": results, "log": log_lines,
    }
    rpath = Path(a.report) if a.report else out.parent / f"{out.name}_train.json"
    rpath.write_text(json.dumps(report, indent=1))
    log(f"report {rpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
