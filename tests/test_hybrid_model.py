"""Qwen3.5 hybrid (Gated DeltaNet + gated attention) at the model level, fp32, against transformers
on the same random checkpoint: varlen batches of mixed lengths, prefill in chunks that continue the
stored recurrent state, decode steps, layer patterns, GQA ratios and head dims 128 / 256; the image-
text release (language model under model.language_model.); the chunked torch delta rule against a
token-by-token float64 recurrence; Qwen3-Next refused with its reason."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ninfer.attention.reference import ReferenceAttentionBackend
from ninfer.kvcache.pool import KVCachePool
from ninfer.layers.gdn import gated_delta_rule_ref
from ninfer.model_config import ConfigError
from ninfer.models import load_model
from tests.tiny_models import build_metadata, make_hybrid_checkpoint, use_transformers_torch_gdn

use_transformers_torch_gdn()

PAGE = 16
ATOL = 2e-4
GEOMETRIES: dict[str, dict[str, Any]] = {
    "lf-d128-g2": dict(layer_types=("linear", "full"), heads=4, kv_heads=2, head_dim=128),
    "llfl-d256-g4": dict(layer_types=("linear", "linear", "full", "linear"), heads=4, kv_heads=1, head_dim=256,
                         linear_k_heads=1, linear_v_heads=3),
    "fl-d128-g1": dict(layer_types=("full", "linear"), heads=2, kv_heads=2, head_dim=128, linear_k_heads=2,
                       linear_v_heads=2, conv_kernel=3, partial_rotary=0.5),
}
_CACHE: dict[str, tuple[Any, Any, Path]] = {}


def _pair(tmp_path_factory: pytest.TempPathFactory, key: str, **extra: Any) -> tuple[Any, Any, Path]:
    from transformers import AutoModelForCausalLM
    if key not in _CACHE:
        path = make_hybrid_checkpoint(tmp_path_factory.mktemp("hyb"), **GEOMETRIES.get(key, {}), **extra)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() if not extra else None
        _CACHE[key] = (load_model(path, dtype="fp32", progress=False), hf, path)
    return _CACHE[key]


def _backend(model: Any, kv_dtype: str = "auto", slots: int = 4) -> ReferenceAttentionBackend:
    """The reference backend over a pool built from the model's own cache spec (pages for the
    attention layers, `slots` state slots for the GDN layers)."""
    from ninfer.kvcache.formats import get_format
    spec = model.cache_specs(get_format(kv_dtype))
    return ReferenceAttentionBackend(KVCachePool.from_spec(spec, 64, slots, "cpu", model.dtype, page_size=PAGE))


@torch.no_grad()
def _step(model: Any, backend: ReferenceAttentionBackend, chunks: list[torch.Tensor], starts: list[int],
          slots: list[int], first_pages: list[int]) -> list[torch.Tensor]:
    q_lens = [len(c) for c in chunks]
    meta = build_metadata(q_lens, [s + n for s, n in zip(starts, q_lens)], PAGE, first_pages)
    meta.state_slots = torch.tensor(slots, dtype=torch.int32)
    meta.has_initial_state = torch.tensor([s > 0 for s in starts])
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    return list(model.compute_logits(model(torch.cat(chunks), positions, meta, backend)).split(q_lens))


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("key", list(GEOMETRIES))
def test_varlen_chunked_prefill_and_decode_match_transformers(tmp_path_factory, key: str) -> None:
    """Two sequences (90 and 37 tokens, several pages) in chunks of uneven size sharing steps, in
    state slots 2 and 0 (slot 1, stale, must not leak in), then 3 decode steps of both; every
    logit against transformers' full forward of the whole sequence."""
    model, hf, _ = _pair(tmp_path_factory, key)
    vocab = model.config.vocab_size
    seqs = [_prompt(93, vocab, 1), _prompt(40, vocab, 2)]
    backend = _backend(model)
    for st in backend.pool.states:  # a stale slot: reading it instead of zeros would show
        st["ssm"][1].fill_(3.0)
        st["conv"][1].fill_(-2.0)
    got: list[list[torch.Tensor]] = [[], []]
    plan = [((0, 50), (0, 16)), ((50, 90), (16, 37))] + [((90 + i, 91 + i), (37 + i, 38 + i)) for i in range(3)]
    for (a0, a1), (b0, b1) in plan:
        la, lb = _step(model, backend, [seqs[0][a0:a1], seqs[1][b0:b1]], [a0, b0], [2, 0], [0, 8])
        got[0].append(la)
        got[1].append(lb)
    for s, seq in enumerate(seqs):
        ours = torch.cat(got[s])
        ref = hf(seq[None]).logits[0, :len(ours)].float()
        err = (ours - ref).abs().max().item()
        assert err < ATOL * max(1.0, ref.abs().max().item()), f"seq {s}: max |diff| {err}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_quantized_kv_stays_close(tmp_path_factory) -> None:
    """rk4v4-e8 and int8 KV on the attention layers (GDN state stays fp32): next-token KL against
    unquantized KV over a 130-token prompt, bounded."""
    model, _, _ = _pair(tmp_path_factory, "lf-d128-g2")
    seq = _prompt(130, model.config.vocab_size, 5)
    outs = {}
    for fmt in ("auto", "int8", "rk4v4-e8"):
        b = _backend(model, fmt)
        outs[fmt] = torch.cat([_step(model, b, [seq[i:i + 64]], [i], [0], [0])[0] for i in (0, 64, 128)])
    logp = torch.log_softmax(outs["auto"], -1)
    for fmt, bound in (("int8", 1e-4), ("rk4v4-e8", 5e-3)):
        kl = (logp.exp() * (logp - torch.log_softmax(outs[fmt], -1))).sum(-1)
        print(f"hybrid next-token KL {fmt}: mean {kl.mean().item():.2e} max {kl.max().item():.2e}")
        assert kl.mean().item() < bound, (fmt, kl.mean().item())
        assert kl.mean().item() > 0  # the quantization is really on the attention path


def test_image_text_release_serves_its_language_model(tmp_path_factory, caplog) -> None:
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration
    with caplog.at_level("WARNING"):
        model, _, path = _pair(tmp_path_factory, "vl", layer_types=("linear", "full"), head_dim=128, vision=True)
    assert model.config.architecture == "Qwen3_5ForConditionalGeneration"
    assert "vision tower" in caplog.text and "ignored" not in caplog.text
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    seq = _prompt(70, model.config.vocab_size, 3)
    ours = _step(model, _backend(model), [seq], [0], [0], [0])[0]
    with torch.no_grad():
        ref = hf(input_ids=seq[None]).logits[0].float()
    assert (ours - ref).abs().max().item() < ATOL * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_delta_rule_matches_float64_recurrence(seed: int) -> None:
    """gated_delta_rule_ref (chunked, float32) against the token-by-token recurrence in float64,
    from a random initial state, over 150 tokens (chunks of 64 + a partial one)."""
    gen = torch.Generator().manual_seed(seed)
    n, h, dk, dv = 150, 3, 16, 8
    k = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1) * dk ** -0.5
    v = torch.randn(n, h, dv, generator=gen)
    g = -torch.rand(n, h, generator=gen) * 0.5
    beta = torch.rand(n, h, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen)
    o, s1 = gated_delta_rule_ref(q, k, v, g, beta, s0)
    s = s0.double()
    ref = []
    for t in range(n):
        s = s * g[t].double().exp()[:, None, None]
        u = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hkv,hk->hv", s, k[t].double()))
        s = s + k[t].double()[:, :, None] * u[:, None, :]
        ref.append(torch.einsum("hkv,hk->hv", s, q[t].double()))
    assert torch.allclose(o.double(), torch.stack(ref), atol=1e-4)
    assert torch.allclose(s1.double(), s, atol=1e-4)


def test_qwen3_next_is_refused_with_the_reason(tmp_path: Path) -> None:
    import json
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=512, full_attention_interval=4)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="MoE"):
        load_model(tmp_path, progress=False)
