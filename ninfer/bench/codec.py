"""SNR and bits per value of every KV codec (`ninfer bench codec`), on CPU.

SNR = 10 log10(signal power / error power) over all values of a data set, computed in float64
against the unquantized input, in the original (un-rotated) domain. Data sets:
  (a) gauss  i.i.d. N(0, 1);
  (b) heavy  Student-t (3 dof) values with log-normal per-channel scales, a per-channel offset
             and 4 outlier channels at 30x, all *before* the H64 rotation (K-like structure);
  runs       N(0,1) plus an offset shared by all tokens that is constant over runs of 16 channels
             (structure aligned with Sylvester rows: what the format's sign pattern is for);
  (c) model-k / model-v  K (after RoPE and k-norm) and V of a real HF checkpoint (``--model``),
             read from transformers' own cache after one forward pass over a probe-style long
             document (--samples / 2 tokens); also reported per layer and KV head.
Besides the servable formats (rk4v4-e8 with its shipped encoder, the scale refit), rk4v4-e8's first
encoder (``rk4v4-e8:baseline``: absmax / 8 and the nearest points) and reference codecs that are NOT formats: the seed lineage's collapsed
E8 (E8 point of x/(absmax/7) rounded back to integers, no coset bit), a TurboQuant-like Lloyd-Max
16-level quantizer with one fp16 norm per 128 rotated values, two rk4v4-e8 variants
(plain H64 without the format's sign pattern; per-group choice of C with the same decoder) and the Gaussian
rate-distortion bound 6.02*bits dB.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Callable

import torch

from ninfer.kvcache import e8
from ninfer.kvcache.formats import FORMAT_NAMES, GROUP, code_units, get_format, group_scales
from ninfer.kvcache.hadamard import h64, rotate

Codec = Callable[[torch.Tensor], torch.Tensor]  # x [N, D] float32 -> reconstruction [N, D]
SEARCH_C = (7.0, 7.5, 8.0, 8.5, 9.0, 9.5, 10.0, 11.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--model", default=None, help="HF checkpoint directory: also measure its real K/V")
    p.add_argument("--samples", type=int, default=8192, help="vectors of 256 values per synthetic data set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-c", action="store_true", help="also sweep the scale constant C on N(0,1)")
    p.add_argument("--text", action="store_true",
                   help="with --model: K/V of the shipped English passages (bench/data) instead of a probe document")


# ----------------------------------------------------------------------------- data
def gauss_data(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(seed))


def heavy_data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    chi2 = (torch.randn(3, n, 256, generator=g) ** 2).sum(0)  # 3 degrees of freedom
    t = torch.randn(n, 256, generator=g) / torch.sqrt(chi2 / 3.0)
    ch = torch.exp(torch.randn(256, generator=g))  # log-normal channel scales
    ch[torch.randperm(256, generator=g)[:4]] *= 30.0  # outlier channels
    off = torch.randn(256, generator=g) * 2.0
    return (t * ch + off).float()


def runs_data(n: int, seed: int) -> torch.Tensor:
    """N(0,1) plus one offset shared by all tokens, constant over runs of 16 channels (2 sigma)."""
    g = torch.Generator().manual_seed(seed + 2)
    off = (torch.randn(256 // 16, generator=g) * 2.0).repeat_interleave(16)
    return torch.randn(n, 256, generator=g) + off


def model_kv(model_dir: str, tokens: int, seed: int, text: bool = False) -> dict[str, list[torch.Tensor]]:
    """K (post-RoPE, post k-norm) and V as cached by transformers after one forward pass over a
    probe-style long document (needles in filler, ninfer.tools.probe.data): per layer [kv_heads, N, head_dim]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ninfer.tools.probe import data
    from ninfer.tools.probe.evaluate import encoder

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    limit = min(tokens, int(getattr(cfg, "max_position_embeddings", tokens) or tokens))
    ids = None
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        if text:  # the passages one after another
            from ninfer.bench.kv_sim import documents
            ids = tok("\n\n".join(documents().values()), return_tensors="pt").input_ids[:, :limit]
        else:
            hay = data.bench_haystack(limit, seed, encoder(tok))
            ids = tok(data.chat_prompt(hay.text, hay.needles[0].key), return_tensors="pt").input_ids[:, :limit]
    except Exception:  # a checkpoint without a usable tokenizer
        ids = None
    if ids is None or ids.shape[-1] < 16:  # fixed random ids still give the model's real K/V
        ids = torch.randint(0, int(cfg.vocab_size), (1, limit), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    return {"model-k": [layer.keys[0].float() for layer in cache.layers],
            "model-v": [layer.values[0].float() for layer in cache.layers]}


def per_head_snr(kv: dict[str, list[torch.Tensor]], formats=("int8", "rk4v4", "rk4v4-e8:baseline", "rk4v4-e8")
                 ) -> dict[str, dict]:
    """SNR per (K/V, layer, KV head) for the servable formats: {"model-k": {"L0H0": {fmt: dB}}}."""
    out: dict[str, dict] = {}
    for name, layers in kv.items():
        for li, t in enumerate(layers):
            for h in range(t.shape[0]):
                x = t[h]
                out.setdefault(name, {})[f"L{li}H{h}"] = {f: snr_db(x, _codec(f)(x)) for f in formats}
    return out


# ----------------------------------------------------------------------------- codecs
def _codec(name: str) -> Codec:
    from ninfer.bench.kv_sim import format_codec
    return format_codec(name)


def _format_codec(name: str) -> Codec:
    f = get_format(name)
    return lambda x: f.decode(*f.encode(x)).float()


def _scaled(xr: torch.Tensor, c: float, quant: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Rotated-domain reconstruction with fp16 per-64 scales absmax/c and a code-unit quantizer."""
    _, s = group_scales(xr, c, round_up=True)  # the 4-bit rule
    q = quant(code_units(xr, s))
    return (q.reshape(*q.shape[:-1], -1, GROUP) * s).reshape(xr.shape)


def _e8_points(z: torch.Tensor) -> torch.Tensor:
    return e8.decode_e8(e8.encode_e8(z))


def seed_collapsed_e8(x: torch.Tensor) -> torch.Tensor:
    def q(z: torch.Tensor) -> torch.Tensor:
        return torch.round(_e8_points(z)).clamp(-8, 7)  # half-integer points collapse, no coset bit
    return rotate(_scaled(rotate(x), 7.0, q))


def e8_plain_h64(x: torch.Tensor) -> torch.Tensor:
    """rk4v4-e8 with plain Sylvester H64 (no sign pattern): what the sign pattern buys."""
    h = h64()
    rot = lambda v: (v.reshape(*v.shape[:-1], -1, GROUP) @ h).reshape(v.shape)  # noqa: E731
    return rot(_scaled(rot(x), get_format("rk4v4-e8").scale_divisor, _e8_points))


def e8_scale_search(x: torch.Tensor) -> torch.Tensor:
    """Same stored format and decoder as rk4v4-e8; the encoder picks per group the best C of SEARCH_C."""
    xr = rotate(x)
    best, best_err = None, None
    for c in SEARCH_C:
        y = _scaled(xr, c, _e8_points)
        err = ((y - xr) ** 2).reshape(*x.shape[:-1], -1, GROUP).sum(-1, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            take = err < best_err
            best = torch.where(take, y.reshape(best.shape[0], -1, GROUP), best.reshape(best.shape[0], -1, GROUP)).reshape(xr.shape)
            best_err = torch.minimum(err, best_err)
    return rotate(best)


def lloyd_max_gauss(levels: int = 16, iters: int = 300) -> torch.Tensor:
    """MSE-optimal levels for N(0,1) by the fixed-point centroid iteration."""
    pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    y = [(-2.5 + 5.0 * (i + 0.5) / levels) for i in range(levels)]
    for _ in range(iters):
        b = [-math.inf] + [(y[i] + y[i + 1]) / 2 for i in range(levels - 1)] + [math.inf]
        y = [(pdf(b[i]) - pdf(b[i + 1])) / max(cdf(b[i + 1]) - cdf(b[i]), 1e-300) for i in range(levels)]
    return torch.tensor(y, dtype=torch.float64)


def turboquant_like(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 128:
        raise ValueError("one norm per 128 rotated values needs head_dim % 128 == 0")
    lv = lloyd_max_gauss().float()
    xr = rotate(x)
    blk = xr.reshape(x.shape[0], -1, 128)
    norm = blk.norm(dim=-1, keepdim=True).half().float()  # fp16 norm per 128
    u = torch.where(norm > 0, blk / norm.clamp_min(1e-30) * math.sqrt(128), 0.0)
    idx = torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)
    y = lv[idx] * norm / math.sqrt(128)
    return rotate(y.reshape(xr.shape))


def codecs(d: int) -> list[tuple[str, float, Codec]]:
    """(name, bits per value, codec) for head dim d."""
    out: list[tuple[str, float, Codec]] = []
    for name in FORMAT_NAMES:
        out.append((name, 8.0 * get_format(name).bytes_per_token_head(d, torch.float32) / (2 * d), _format_codec(name)))
    side = 16.0 / GROUP
    from ninfer.bench.kv_sim import e8_baseline
    out += [
        ("rk4v4-e8:baseline", 4 + side, e8_baseline),  # the first encoder (no refit), same format
        ("ref:seed-collapsed-e8", 4 + side, seed_collapsed_e8),
        ("ref:turboquant-lm16", 4 + 16.0 / 128, turboquant_like),
        ("ref:e8-plain-h64", 4 + side, e8_plain_h64),
        ("ref:e8+scale-search", 4 + side, e8_scale_search),
    ]
    return out


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float | None:
    x, y = x.double(), y.double()
    err = float(((x - y) ** 2).sum())
    return None if err == 0 else 10 * math.log10(float((x * x).sum()) / err)


# ----------------------------------------------------------------------------- run
def measure(datasets: dict[str, torch.Tensor]) -> dict[str, dict[str, dict[str, float | None]]]:
    res: dict[str, dict[str, dict[str, float | None]]] = {}
    for dname, x in datasets.items():
        for cname, bits, fn in codecs(x.shape[-1]):
            row = res.setdefault(cname, {})
            row["bits_per_value"] = round(bits, 4)
            try:
                row[dname] = snr_db(x, fn(x))
            except ValueError:  # head_dim not a multiple of 64: the grouped codecs do not apply
                row[dname] = None
    for b in (4.0, 4.25):  # the Gaussian rate-distortion bound: meaningful for the gauss column only
        res[f"bound:shannon@{b:g}"] = {"bits_per_value": b, **{d: (6.02 * b if d == "gauss" else None) for d in datasets}}
    return res


def sweep_c(x: torch.Tensor) -> dict[str, dict[str, float]]:
    xr = rotate(x)
    quants = {"rk4v4": lambda z: torch.round(z).clamp(-8, 7), "rk4v4-e8": _e8_points}
    cs = [7.0, 7.5, 7.75, 8.0, 8.25, 8.5, 8.75, 9.0]
    return {name: {f"{c:g}": snr_db(x, rotate(_scaled(xr, c, q))) for c in cs} for name, q in quants.items()}


def _cell(cname: str, v: float | None) -> str:
    if v is None:  # no error at all, or not applicable (bounds outside gauss, head_dim % 64 != 0)
        return "exact" if cname in ("auto", "bf16") else "-"
    return f"{v:.2f}"


def run(args: argparse.Namespace) -> int:
    t0 = time.time()
    n = max(64, int(args.samples))
    datasets = {"gauss": gauss_data(n, args.seed), "heavy": heavy_data(n, args.seed), "runs": runs_data(n, args.seed)}
    heads = None
    if args.model:
        kv = model_kv(args.model, tokens=max(16, n // 2), seed=args.seed, text=args.text)
        datasets.update({k: torch.cat([t.reshape(-1, t.shape[-1]) for t in ts]) for k, ts in kv.items()})
        heads = per_head_snr(kv)
    res = measure(datasets)
    out = {"samples": n, "seed": args.seed, "values": {k: int(v.numel()) for k, v in datasets.items()},
           "head_dim": {k: int(v.shape[-1]) for k, v in datasets.items()}, "snr_db": res,
           "model": args.model, "per_head_snr_db": heads, "seconds": round(time.time() - t0, 1)}
    if args.sweep_c:
        out["sweep_c_gauss"] = sweep_c(datasets["gauss"])
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    names = list(datasets)
    print("codec SNR (dB, signal/error power) -- values per set: " + ", ".join(f"{k}={v}" for k, v in out["values"].items()))
    print(f"{'codec':<24}{'bits/value':>11}" + "".join(f"{d:>10}" for d in names))
    for cname, row in res.items():
        cells = "".join(f"{_cell(cname, row[d]):>10}" for d in names)
        print(f"{cname:<24}{row['bits_per_value']:>11.3f}{cells}")
    for name, rows in (heads or {}).items():
        fmts = list(next(iter(rows.values())))
        print(f"{name} SNR per layer/KV head (dB): " + "  ".join(
            f"{lh} " + "/".join(f"{r[f]:.2f}" for f in fmts) for lh, r in rows.items()) + f"  ({'/'.join(fmts)})")
    if args.sweep_c:
        for name, sw in out["sweep_c_gauss"].items():
            print(f"C sweep gauss {name}: " + "  ".join(f"{c}:{v:.3f}" for c, v in sw.items()))
    print(f"({out['seconds']} s)")
    return 0
