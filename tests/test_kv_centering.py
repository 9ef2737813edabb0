"""Key centring and smoothing before KV quantization (ninfer/kvcache/centering.py).

(k - m) / s stored with queries q * s must attend exactly as k and q do: checked in float64 through
the paged cache (prefill, prefill with cached pages, decode, two sequences) for the dense and the
gated attention layer. The engine's calibration must see the keys transformers' own model has; bf16
KV greedy tokens stay the same with it on; and on SmolLM2's real text it lowers rk4v4-e8's next-token
KL (against unquantized KV, transformers' model) by the bound checked here."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer.attention.base import BaseAttentionBackend
from ninfer.kvcache import centering
from ninfer.kvcache.pool import KVCachePool
from ninfer.layers.attention import Attention
from tests.tiny_models import build_metadata

PAGE = 16
HQ, HKV, D, HID = 4, 2, 64, 48


def _layer(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "dense":
        mod = Attention(HID, HQ, HKV, D, kv_layer=0, qkv_bias=True, o_bias=False, qk_norm=True, eps=1e-6)
    else:
        from ninfer.models.qwen3_5 import GatedAttention
        cfg = SimpleNamespace(hidden_size=HID, head_dim=D, num_heads=HQ, num_kv_heads=HKV, attention_bias=False,
                              rms_norm_eps=1e-6)
        mod = GatedAttention(cfg, kv_layer=0)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.ndim > 1 else 1.0) + (1.0 if p.ndim == 1 else 0.0))
    return mod.double().eval()


class _Fp64Paged(BaseAttentionBackend):
    """Paged K/V by slot and causal attention, all in float64 (the shipped CPU backend attends in
    float32, which would hide a 1e-12 check)."""
    name = "fp64"

    def __init__(self, slots: int) -> None:
        self.k = torch.zeros(slots, HKV, D, dtype=torch.float64)
        self.v = torch.zeros(slots, HKV, D, dtype=torch.float64)

    def forward(self, layer, q, k, v, meta, scale):
        self.k[meta.slot_mapping], self.v[meta.slot_mapping] = k, v
        out = torch.empty_like(q)
        for b in range(meta.num_seqs):
            q0, q1, n = int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]), int(meta.seq_lens[b])
            slots = (meta.block_tables[b].long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n]
            kk, vv = (t[slots].repeat_interleave(HQ // HKV, 1) for t in (self.k, self.v))  # [n, Hq, D]
            sc = torch.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
            qpos = torch.arange(n - (q1 - q0), n)
            sc = sc.masked_fill(torch.arange(n)[None, None, :] > qpos[None, :, None], float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), vv)
        return out


def _run(mod: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Two sequences of 40 tokens: prefill 24 (+ 20), prefill 12 more (+ 16) over their cached pages,
    then decode one token at a time. Returns every step's output."""
    backend = _Fp64Paged(16 * PAGE)
    pos = torch.arange(64, dtype=torch.float64)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    plan = [((0, 24), (0, 20)), ((24, 36), (20, 36))] + [((n, n + 1), (n, n + 1)) for n in range(36, 40)]
    outs = []
    with torch.no_grad():
        for (a0, a1), (b0, b1) in plan:
            meta = build_metadata([a1 - a0, b1 - b0], [a1, b1], PAGE, first_pages=[0, 8])
            h = torch.cat([x[0, a0:a1], x[1, b0:b1]])
            p = torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)])
            outs.append(mod(h, cos[p], sin[p], meta, backend))
    return outs


@pytest.mark.parametrize("kind", ["dense", "gated"])
@pytest.mark.parametrize("seed", [0, 1])
def test_centred_attention_is_exact_in_fp64(kind: str, seed: int) -> None:
    mod = _layer(kind, seed)
    g = torch.Generator().manual_seed(10 + seed)
    x = torch.randn(2, 40, HID, generator=g, dtype=torch.float64)
    ref = _run(mod, x)
    m = 5.0 * torch.randn(HKV, D, generator=g, dtype=torch.float64)  # large offsets, wide scale spread
    s = torch.exp(torch.randn(HKV, D, generator=g, dtype=torch.float64))
    mod.key_transform = centering.KeyTransform(m, s, HQ)
    got = _run(mod, x)
    for r, o in zip(ref, got):
        assert (o - r).abs().max() <= 1e-12 * max(1.0, float(r.abs().max()))
    mod.key_transform = centering.KeyTransform(m, s, HQ)  # and the transform is really applied
    q, k = torch.ones(3, HQ, D, dtype=torch.float64), torch.ones(3, HKV, D, dtype=torch.float64)
    q2, k2 = mod.key_transform(q, k)
    assert torch.allclose(k2[0], (1 - m) / s) and torch.allclose(q2[0, 1], s[0]) and torch.allclose(q2[0, 2], s[1])


def test_key_statistics() -> None:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(50, 2, 8, generator=g, dtype=torch.float64) * torch.arange(1, 9) + 3.0
    keys[0] = 100.0  # the first token is left out
    m, s = centering.key_statistics(keys, alpha=0.5)
    body = keys[1:]
    assert torch.allclose(m, (body.amax(0) + body.amin(0)) / 2)
    r = (body - m).abs().amax(0)
    assert torch.allclose(s / s[..., :1], (r / r[..., :1]) ** 0.5)
    assert torch.allclose(s.log().mean(-1), torch.zeros(2, dtype=torch.float64), atol=1e-12)
    m0, s0 = centering.key_statistics(keys, alpha=0.0)
    assert torch.equal(m0, m) and torch.allclose(s0, torch.ones_like(s0))
    with pytest.raises(ValueError, match="more than 1 token"):
        centering.key_statistics(keys[:1])


def test_calibration_sees_transformers_keys(tiny_checkpoint) -> None:
    """The engine's calibration pass over our model gives transformers' model's statistics."""
    from ninfer.bench import kv_sim
    from ninfer.models.loader import load_model

    path = tiny_checkpoint(arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=384)
    ours = load_model(path, dtype="fp32", progress=False)
    hf, tok = kv_sim.load(str(path))
    ids = tok(centering.PASSAGE.read_text(encoding="utf-8")).input_ids[:96]
    pool = KVCachePool("auto", 2, 2, 64, 2, page_size=PAGE, model_dtype=torch.float32)
    got = centering.calibrate(ours, ids, pool, torch.device("cpu"))
    want = kv_sim.key_stats(hf, torch.tensor([ids]), centering.ALPHA)
    assert sorted(got) == sorted(want) == [0, 1]
    for i in want:
        for a, b in zip(got[i], want[i]):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    assert all(mod.key_transform is None for mod in centering.attention_layers(ours))  # calibration left none


def test_engine_bf16_greedy_unchanged_with_centring() -> None:
    from ninfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The lighthouse keeper climbed the stairs and", "Bread needs flour, water, salt and"]
    toks, lines = {}, {}
    for on in (False, True):
        llm = LLM(None, kv_dtype="bf16", device="cpu", max_context=256, kv_centering=on)
        lines[on] = [x for x in llm.engine.startup_lines if x.startswith("kv centring")]
        toks[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if on:
            assert all(mod.key_transform is not None for mod in centering.attention_layers(llm.engine.model))
    assert lines[False] == ["kv centring: off"] and lines[True][0].startswith("kv centring: on")
    assert toks[True] == toks[False]


def test_quantized_default_on_and_flag_off() -> None:
    from ninfer import LLM

    for kv, flag, want in (("rk4v4-e8", None, "on"), ("int8", None, "on"), ("rk4v4-e8", False, "off"),
                           ("bf16", None, "off")):
        llm = LLM(None, kv_dtype=kv, device="cpu", max_context=128, kv_centering=flag)
        line = next(x for x in llm.engine.startup_lines if x.startswith("kv centring"))
        assert line.startswith(f"kv centring: {want}"), (kv, flag, line)


@pytest.mark.slow
def test_centring_lowers_smollm2_kl() -> None:
    """rk4v4-e8 next-token KL (K and V quantized, transformers' SmolLM2) over two held-out passages."""
    from ninfer.bench import kv_sim
    from ninfer.checkpoints import resolve_model

    model, tok = kv_sim.load(str(resolve_model("smollm2")))
    docs = {k: v for k, v in kv_sim.documents().items() if k in ("river", "letter")}
    ids = kv_sim.token_ids(tok, docs, 192)
    refs = {k: kv_sim.log_probs(model, x) for k, x in ids.items()}
    cal = torch.tensor([tok(centering.PASSAGE.read_text(encoding="utf-8")).input_ids[:centering.TOKENS]])
    codec = kv_sim.format_codec("rk4v4-e8")
    plain = kv_sim.doc_kl(model, ids, refs, codec)
    cent = kv_sim.doc_kl(model, ids, refs, codec, keys=kv_sim.key_stats(model, cal, centering.ALPHA))
    for name in docs:
        assert cent[name] < 0.8 * plain[name], (name, cent[name], plain[name])


@pytest.mark.slow
def test_engine_centring_lowers_smollm2_kl() -> None:
    """The shipped path: rk4v4-e8 engines with centring on and off, teacher-forced along bf16 KV's
    greedy tokens after a real passage (prefill and decode read the quantized pages)."""
    from ninfer import LLM
    from ninfer.bench.kl import compare, teacher_forced
    from ninfer.bench.kv_sim import documents

    docs = documents()
    run = {}
    for kv, on in (("bf16", None), ("rk4v4-e8", True), ("rk4v4-e8", False)):
        llm = LLM("smollm2", kv_dtype=kv, device="cpu", max_context=256, kv_centering=on)
        prompts = [llm.engine.tokenizer.encode(docs[n])[:160] for n in ("river", "letter")]
        run[(kv, on)] = teacher_forced(llm, prompts, 12, None if kv == "bf16" else run[("bf16", None)][0])
        del llm
    ref = run[("bf16", None)][1]
    on, off = compare(ref, run[("rk4v4-e8", True)][1]), compare(ref, run[("rk4v4-e8", False)][1])
    assert 0 < on["mean_kl"] < 0.8 * off["mean_kl"], (on, off)
