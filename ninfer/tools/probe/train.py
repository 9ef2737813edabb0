"""Train the bundled probe model (a small Qwen3) on synthetic long-document retrieval.

    python -m ninfer.tools.probe.train --out DIR [--minutes M] [--seed S] [--device cuda] [--tiny]

Recipe (why each piece is there):
* Every needle of a document is asked at the end, as a multi-turn chat, with the loss on all
  answers (dense supervision); filler and questions get a small LM loss so the model also
  writes text-like output.
* The answer repeats the needle sentence; keys are single tokens and " is NN" + "NN" the value
  (tokenizer.py), so retrieval is two induction steps: after the key, copy what followed the
  same key in the document; after " is NN", copy what followed it (unique per document).
* Match phase: short documents (--min-len) with 2-4 needles and about half filler, many small
  steps, plain positions, clean K/V, until the training answers are --match-exact right (or
  --hold of the run has passed). Key matching forms there: CPU runs formed it with 2-4 needles
  and filler, not with needle-dense documents (docs/BENCHMARKS.md "Probe model").
* Then a length curriculum to --max-len over --grow of the remaining time, each batch's length
  log-uniform up to the cap; up to --max-needles needles per document.
* Position gaps (after the match phase): with probability 1/2 a document's positions jump at a
  few filler sentence boundaries (total up to --gap-mult x its length) plus a random offset,
  so relative distances far beyond the trained length are seen while sentences stay contiguous.
* K/V noise (after the match phase): on half of the steps Gaussian noise of --kv-noise x RMS
  is added to keys (after k_norm) and values, the size of the rk4v4-e8 codec's error (~9%).
* AdamW (weight decay 0.1 on matrices only: with QK-norm the norm gains alone set how sharp
  attention can get, and decaying them toward 0 fights the long-context lookup), 100-step
  warmup, cosine to 0.1x, grad clip 1.0. Batches come from pre-tokenized parts (batches.py).
The run stops itself by wall clock, evaluates exact retrieval on held-out documents at several
lengths (greedy, transformers, the bf16 weights as shipped; plain RoPE and YaRN), writes the HF
directory and a JSON report.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import data
from .batches import TokenBank
from .evaluate import evaluate
from .tokenizer import VOCAB_SIZE, build_tokenizer, special_ids, wrap

# 6 Q heads per KV head, head_dim 256 (the geometry the probe exists to exercise). "narrow": 6 Q /
# 1 KV; "full": 12 Q / 2 KV; "deep": 6 layers.
FULL = dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2,
            head_dim=256, intermediate_size=512)
NARROW = dict(hidden_size=384, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=1,
              head_dim=256, intermediate_size=1024)
DEEP = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=1,
            head_dim=256, intermediate_size=768)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=128)


def doc_length(progress: float, match_end: float | None, min_len: int, max_len: int, grow: float,
               rng: random.Random) -> int:
    """--min-len during the match phase; then a cap growing geometrically to max_len over `grow`
    of the remaining run, each batch log-uniform between min_len and the cap (x64)."""
    lo = min(min_len, max_len)
    if match_end is None:
        return lo
    span = max(1e-6, grow * (1.0 - match_end))
    cap = lo * (max_len / lo) ** min(1.0, max(0.0, (progress - match_end) / span))
    L = math.exp(rng.uniform(math.log(lo), math.log(cap)))
    return max(lo, int(L) // 64 * 64)


def needle_range(L: int, max_needles: int) -> tuple[int, int]:
    """2-4 needles at the match-phase length (about half of it filler), up to max_needles in long
    documents (one per 48 tokens at most)."""
    return 2, max(2, min(max_needles, L // 48))


def _noise_hooks(model, level: float, active: list[bool]) -> None:
    def hook(_mod, _inp, out):
        if not active[0] or level <= 0:
            return out
        rms = out.float().pow(2).mean(-1, keepdim=True).sqrt()
        return out + (torch.randn_like(out, dtype=torch.float32) * rms * level).to(out.dtype)
    for layer in model.model.layers:
        layer.self_attn.k_norm.register_forward_hook(hook)
        layer.self_attn.v_proj.register_forward_hook(hook)


def param_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices only; norm gains and the (tied) embedding are left alone."""
    dec = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return [{"params": dec, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ninfer.tools.probe.train", description=__doc__.split("\n")[0])
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
    ap.add_argument("--min-len", type=int, default=192, help="match-phase document length")
    ap.add_argument("--batch-tokens", type=int, default=12288,
                    help="tokens per step; small steps: key matching needs many updates, not big batches")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--gap-mult", type=float, default=15.0,
                    help="position gaps up to this x the document length: 4096 x 16 spans the 64K grid point")
    ap.add_argument("--kv-noise", type=float, default=0.1)
    ap.add_argument("--lm-weight", type=float, default=0.02)
    ap.add_argument("--match-exact", type=float, default=0.9,
                    help="leave the match phase once this fraction of training answers is exact")
    ap.add_argument("--hold", type=float, default=0.5, help="longest match phase, as a fraction of the run")
    ap.add_argument("--grow", type=float, default=0.5,
                    help="fraction of the run after the match phase over which --max-len is reached")
    ap.add_argument("--max-needles", type=int, default=8)
    ap.add_argument("--eval-lengths", default="1024,4096,16384,32768,65536")
    ap.add_argument("--eval-docs", type=int, default=4)
    a = ap.parse_args(argv)
    if a.tiny:
        a.max_len, a.min_len, a.batch_tokens = min(a.max_len, 256), min(a.min_len, 128), min(a.batch_tokens, 2048)
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
    bank = TokenBank(tok, seed=a.seed)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; bank of {len(bank.sentences)} filler sentences")

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
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=a.lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    budget = a.minutes * 60
    sched_rng = random.Random(a.seed)
    data_rng = np.random.default_rng(a.seed)
    t0 = time.time()
    step, n_tok, last_log, hist = 0, 0, t0, []
    agg = {"loss": 0.0, "acc": 0.0, "exact": 0.0, "n": 0}
    match_end, ema = None, 0.0  # progress at which the match phase ended; EMA of answer exact
    while time.time() - t0 < budget:
        progress = (time.time() - t0) / budget
        if match_end is None and (ema >= a.match_exact or progress >= a.hold):
            match_end = progress
            log(f"match phase done at step {step} ({progress:.2f} of the run), answer exact EMA {ema:.3f}")
        L = doc_length(progress, match_end, a.min_len, a.max_len, a.grow, sched_rng)
        ids, pos, wts, seg = bank.batch(data_rng, L, a.batch_tokens, needle_range(L, a.max_needles),
                                        a.gap_mult if match_end is not None else 0.0, a.lm_weight)
        ids, pos, wts = ids.to(dev, non_blocking=True), pos.to(dev), wts.to(dev)
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        noise_on[0] = step % 2 == 1 and match_end is not None
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
        if step % 10 == 0 or a.tiny:  # an answer is exact when all its tokens are the argmax
            with torch.no_grad():
                sg = seg[:, 1:].to(dev)
                ans = sg > 0
                correct = (logits.argmax(-1) == tgt)[ans]
                wrong = torch.zeros(int(sg.max()) + 1, device=dev).index_add_(0, sg[ans], (~correct).float())
                present = torch.zeros_like(wrong).index_add_(0, sg[ans], torch.ones_like(wrong[sg[ans]]))
                exact = float((wrong[present > 0] == 0).float().mean())
                agg["loss"] += float(nll[ans].mean()); agg["acc"] += float(correct.float().mean())
                agg["exact"] += exact; agg["n"] += 1
                ema = 0.9 * ema + 0.1 * exact
        if time.time() - last_log > (5 if a.tiny else 15) and agg["n"]:
            el = time.time() - t0
            m = {k: agg[k] / agg["n"] for k in ("loss", "acc", "exact")}
            hist.append({"step": step, "s": round(el, 1), "L": ids.shape[1], "lr": lr, **{k: round(v, 4) for k, v in m.items()}})
            log(f"step {step} L={ids.shape[1]}x{ids.shape[0]} lr {lr:.2e} answer loss {m['loss']:.3f} "
                f"token acc {m['acc']:.3f} answer exact {m['exact']:.3f} | {n_tok / el / 1e3:.0f}K tok/s")
            agg = {"loss": 0.0, "acc": 0.0, "exact": 0.0, "n": 0}
            last_log = time.time()
    train_s = time.time() - t0
    log(f"trained {step} steps, {n_tok / 1e6:.1f}M tokens in {train_s:.0f}s; match phase ended at "
        f"{'never' if match_end is None else f'{match_end:.2f}'}")

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
        "command": "python -m ninfer.tools.probe.train " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "args": vars(a), "params": n_params, "config": shape,
        "train_seconds": round(train_s, 1), "steps": step, "match_phase_end": match_end, "train_tokens": n_tok,
        "total_seconds": round(time.time() - t_start, 1), "files": files,
        "history": hist, "eval": results, "log": log_lines,
    }
    rpath = Path(a.report) if a.report else out.parent / f"{out.name}_train.json"
    rpath.write_text(json.dumps(report, indent=1))
    log(f"report {rpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
