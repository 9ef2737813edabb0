"""KV quantization simulated inside a transformers model, for next-token KL on real text.

Every attention layer's K (after RoPE and k-norm) and V go through a codec (encode then decode,
the stored bytes' values) before attention, for all positions of a document in one causal forward
pass: each position's next-token distribution then sees the quantized cache of every earlier
token and of itself, as a decode step does. KL(reference || quantized) in nats is averaged over
every position of every document; ``layers`` and ``planes`` restrict the quantization (one layer,
K only, V only). Documents: the public-domain English passages in ``ninfer/bench/data/*.txt``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from ninfer.bench.kv_sim_v2 import CODECS, bits, codec as v2_codec
from ninfer.kvcache import e8
from ninfer.kvcache.formats import code_units, get_format, group_scales
from ninfer.kvcache.hadamard import rotate

Codec = Callable[[torch.Tensor], torch.Tensor]  # x [N, D] float32 -> reconstruction [N, D]
DATA = Path(__file__).resolve().parent / "data"
_ATTN = "ninfer_kv_sim"


def documents() -> dict[str, str]:
    """name -> text of every shipped passage (sorted by file name)."""
    docs = {p.stem: p.read_text(encoding="utf-8") for p in sorted(DATA.glob("*.txt"))}
    if not docs:
        raise FileNotFoundError(f"no documents in {DATA}")
    return docs


def e8_refit(x: torch.Tensor) -> torch.Tensor:
    """rk4v4-e8's bytes from the candidate encoder ``e8.encode_e8_refit`` (least-squares scale refit and
    one re-projection; same bitstream and decoders), decoded: what the format would store with it."""
    xr = rotate(x).to(torch.float32)
    _, s = group_scales(xr, 8.0, round_up=True)
    data, s16 = e8.encode_e8_refit(code_units(xr, s, e8.GRID), s[..., 0])
    p = e8.decode_e8(data)
    return rotate((p.reshape(*p.shape[:-1], -1, 64) * s16.float()[..., None]).reshape(p.shape))


def format_codec(name: str) -> Codec:
    """A servable format's codec (its shipped encoder); ``rk4v4-e8:refit`` is the candidate encoder,
    ``v2:*`` the candidate codecs of ``kv_sim_v2``.
    A ``+c`` / ``+m`` suffix (key centring, ``centred``) leaves the codec as it is."""
    name = base_name(name)
    if name == "rk4v4-e8:refit":
        return e8_refit
    if name.startswith("v2:"):
        return v2_codec(name)
    f = get_format(name)
    return lambda x: f.decode(*f.encode(x)).float()


def base_name(name: str) -> str:
    return name[:-2] if name.endswith(("+c", "+m")) else name


def centred(name: str) -> float | None:
    """The smoothing strength of a ``+c`` (the engine's, ``centering.ALPHA``) or ``+m`` (centring only:
    0) name; None without centring."""
    from ninfer.kvcache import centering
    return centering.ALPHA if name.endswith("+c") else 0.0 if name.endswith("+m") else None


@torch.no_grad()
def key_stats(model, ids: torch.Tensor, alpha: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``centering.key_statistics`` of every layer's keys (after RoPE and k-norm) over ids [1, T]."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ninfer.kvcache.centering import key_statistics
    keys = {}

    def attn(module, query, key, value, attention_mask, **kw):
        keys[module.layer_idx] = key[0].transpose(0, 1)  # [T, Hkv, D]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_ATTN + "_keys", attn)
    old = model.config._attn_implementation
    model.set_attn_implementation(_ATTN + "_keys")
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(old)
    return {i: key_statistics(k, alpha) for i, k in keys.items()}


def centring_stats(model, tok, names: Sequence[str]) -> dict[float, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """For the ``+c`` / ``+m`` names: smoothing strength -> ``key_stats`` over the engine's calibration
    tokens (what the engine calibrates on at startup); empty when no name is centred."""
    alphas = {centred(n) for n in names} - {None}
    if not alphas:
        return {}
    from ninfer.kvcache import centering
    cal = token_ids(tok, {"cal": centering.PASSAGE.read_text(encoding="utf-8")}, centering.TOKENS, model.device)["cal"]
    return {a: key_stats(model, cal, a) for a in alphas}


@contextlib.contextmanager
def quantized_kv(model, codec: Codec | None, layers: Sequence[int] | None = None, planes: str = "kv",
                 keys: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> Iterator[None]:
    """Run ``model``'s attention on codec(K), codec(V) of the selected layers (None: all). With ``keys``
    (layer -> (m, s), ``key_stats``) K is stored centred: s * codec((K - m) / s) + m, which attends
    as the engine's (q * s) . codec((k - m) / s) does (the q.m term is the same for every key)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    chosen = None if layers is None else set(layers)

    def attn(module, query, key, value, attention_mask, **kw):
        if codec is not None and (chosen is None or module.layer_idx in chosen):
            q = lambda t: codec(t.float().reshape(-1, t.shape[-1])).reshape(t.shape).to(t.dtype)  # noqa: E731
            qk, full = getattr(codec, "keys", q), key  # keys: a codec along tokens, on [B, H, T, D]
            if keys is not None and "k" in planes:
                m, s = (x.to(key.device, torch.float64)[None, :, None, :] for x in keys[module.layer_idx])
                key = (qk(((key.double() - m) / s).float()).double() * s + m).to(key.dtype)
            elif "k" in planes:
                key = qk(key)
            value = q(value) if "v" in planes else value
            if "k" in planes and getattr(codec, "window", 0):  # recent keys kept unquantized
                return codec.attend(module, query, key, full, value, **kw)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_ATTN, attn)
    old = model.config._attn_implementation
    model.set_attn_implementation(_ATTN)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def load(model_dir: str, device: str = "cpu"):
    """float32 model on ``device`` ("auto": CUDA where present) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def token_ids(tok, texts: dict[str, str], max_tokens: int, device="cpu") -> dict[str, torch.Tensor]:
    return {k: torch.tensor(tok(t).input_ids[:max_tokens], device=device)[None] for k, t in texts.items()}


@torch.no_grad()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].double(), -1)


def kl(ref_lp: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(ref || q) per position, nats."""
    return (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0)


@torch.no_grad()
def doc_kl(model, ids: dict[str, torch.Tensor], refs: dict[str, torch.Tensor], codec: Codec,
           layers: Sequence[int] | None = None, planes: str = "kv", keys: dict | None = None) -> dict[str, float]:
    """Mean next-token KL per document with the given quantization."""
    out = {}
    with quantized_kv(model, codec, layers, planes, keys):
        for name, x in ids.items():
            out[name] = float(kl(refs[name], log_probs(model, x)).mean())
    return out


def codec_names(spec: str) -> list[str]:
    """Comma-separated servable kv-dtypes, ``rk4v4-e8:refit`` and ``v2:*``, each optionally with ``+c`` or ``+m``
    (keys centred, ``centred``); unknown names raise ValueError."""
    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    for n in names:
        if base_name(n) != "rk4v4-e8:refit" and not (n.startswith("v2:") and v2_codec(base_name(n)) is not None):
            if n.startswith("v2:"):
                raise ValueError(f"unknown codec {n!r}; v2 codecs: {', '.join(CODECS)}")
            get_format(base_name(n))
    if not names:
        raise ValueError("give at least one kv-dtype")
    return names


def run_text(args) -> dict:
    """``ninfer bench kl --text``: next-token KL on the shipped passages, per kv-dtype and plane set,
    and with ``--per-layer`` one layer quantized at a time. Returns the JSON-able result."""
    import time

    t0 = time.time()
    names = codec_names(args.kv_dtype)
    planes = [p.strip() for p in args.planes.split(",") if p.strip()]
    if not planes or any(p not in ("kv", "k", "v") for p in planes):
        raise ValueError(f"--planes takes kv, k and v, got {args.planes!r}")
    if args.tokens < 2:
        raise ValueError("--tokens must be >= 2")
    model, tok = load(args.model, args.device)
    docs = documents()
    stats = centring_stats(model, tok, names)
    if stats:  # the calibration passage is not scored
        from ninfer.kvcache import centering
        docs.pop(centering.PASSAGE.stem, None)
    ids = token_ids(tok, docs, args.tokens, model.device)
    refs = {k: log_probs(model, x) for k, x in ids.items()}
    rows = []
    for name in names:
        for pl in planes:
            per_doc = doc_kl(model, ids, refs, format_codec(name), planes=pl, keys=stats.get(centred(name)))
            v = list(per_doc.values())
            rows.append({"kv_dtype": name, "planes": pl, "bits": bits(name), "mean_kl": sum(v) / len(v),
                         "min_doc": min(v), "max_doc": max(v), "docs": per_doc})
    per_layer = {}
    if args.per_layer:
        for name in names:
            per_layer[name] = [sum(d.values()) / len(d) for d in
                               (doc_kl(model, ids, refs, format_codec(name), layers=[i],
                                       keys=stats.get(centred(name)))
                                for i in range(model.config.num_hidden_layers))]
    return {"bench": "kl-text", "model": args.model, "tokens": {k: int(x.shape[1]) for k, x in ids.items()},
            "rows": rows, "per_layer": per_layer, "seconds": round(time.time() - t0, 1)}


def text_table(res: dict) -> str:
    n = sum(res["tokens"].values())
    lines = [f"next-token KL vs unquantized KV, {len(res['tokens'])} passages, {n} positions (mean over "
             "passages; min / max passage)",
             "| kv-dtype | quantized | mean KL (nats) | min passage | max passage | bits/value |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        b = "" if r.get("bits") is None else f"{r['bits']:.3f}"
        lines.append(f"| {r['kv_dtype']} | {r['planes'].upper()} | {r['mean_kl']:.3e} | {r['min_doc']:.3e} | "
                     f"{r['max_doc']:.3e} | {b} |")
    for name, v in res["per_layer"].items():
        lines.append(f"{name} one layer at a time (K and V): " + " ".join(f"L{i} {x:.2e}" for i, x in enumerate(v)))
    return "\n".join(lines)
