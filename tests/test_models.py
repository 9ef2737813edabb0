"""Full-model parity: our decoder + ReferenceAttentionBackend over the paged pool against the
transformers model on the same checkpoint, fp32 (single prompt, a two-sequence flattened batch,
chunked prefill followed by decode steps), plus rope scaling, tied embeddings, bf16 and a quantized
KV format."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from ninfer.attention.reference import ReferenceAttentionBackend
from ninfer.kvcache.pool import KVCachePool
from ninfer.models import CausalLM, load_model
from tests.tiny_models import build_metadata

PAGE = 16  # small pages so the tests cross page boundaries
ATOL = 1e-4
GEOMETRIES: dict[str, dict[str, Any]] = {
    "qwen3-d64-g6": dict(arch="qwen3"),
    "qwen3-d256-g6": dict(arch="qwen3", heads=6, kv_heads=1, head_dim=256),
    "qwen3-d128-g2": dict(arch="qwen3", hidden=128, heads=4, kv_heads=2, head_dim=128),
    "qwen2-d64-g2": dict(arch="qwen2", hidden=128, heads=2, kv_heads=1, head_dim=64),
    "llama-d128-g2": dict(arch="llama", hidden=128, heads=4, kv_heads=2, head_dim=128),
    "mistral-d64-g1": dict(arch="mistral", hidden=64, heads=2, kv_heads=2, head_dim=64),
    "qwen3-yarn": dict(arch="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32}),
    "llama-llama3": dict(arch="llama", hidden=64, heads=2, kv_heads=1, head_dim=64,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-linear-tied": dict(arch="qwen2", hidden=128, heads=2, kv_heads=1, head_dim=64, tie_word_embeddings=True,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
_MODELS: dict[str, tuple[CausalLM, Any]] = {}


def _load_pair(tiny_checkpoint: Callable[..., Path], key: str) -> tuple[CausalLM, Any]:
    """(our model, transformers' model) in fp32 for a GEOMETRIES entry, cached for the module."""
    if key not in _MODELS:
        path = tiny_checkpoint(**GEOMETRIES[key])
        _MODELS[key] = (load_model(path, dtype="fp32", progress=False),
                        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    return _MODELS[key]


@pytest.fixture(params=list(GEOMETRIES))
def models(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> tuple[CausalLM, Any]:
    return _load_pair(tiny_checkpoint, request.param)


def _pool(model: CausalLM, kv_dtype: str = "auto", pages: int = 32) -> KVCachePool:
    cfg = model.config
    return KVCachePool(kv_dtype, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, pages, page_size=PAGE,
                       model_dtype=model.dtype)


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0].float()


@torch.no_grad()
def _step(model: CausalLM, backend: ReferenceAttentionBackend, chunks: list[torch.Tensor], starts: list[int],
          first_pages: list[int]) -> list[torch.Tensor]:
    """One engine-like step: sequence b gets new tokens chunks[b] at positions starts[b]...; its pages
    are consecutive from first_pages[b]. Returns the logits of every new token, per sequence."""
    q_lens = [len(c) for c in chunks]
    seq_lens = [s + n for s, n in zip(starts, q_lens)]
    meta = build_metadata(q_lens, seq_lens, PAGE, first_pages)
    ids = torch.cat(chunks)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    logits = model.compute_logits(model(ids, positions, meta, backend))
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), model.config.vocab_size)
    return list(logits.split(q_lens))


def test_single_prompt(models: tuple[CausalLM, Any]) -> None:
    model, hf = models
    ids = _prompt(37, model.config.vocab_size, 1)
    (out,) = _step(model, ReferenceAttentionBackend(_pool(model)), [ids], [0], [0])
    ref = _hf_logits(hf, ids)
    assert ref.abs().max() > 1.0  # the random model is not trivially flat
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


def test_two_prompts_one_flattened_batch(models: tuple[CausalLM, Any]) -> None:
    model, hf = models
    a, b = _prompt(70, model.config.vocab_size, 2), _prompt(9, model.config.vocab_size, 3)
    # b's pages come first in the pool: page ids are arbitrary, only the block table matters
    out_a, out_b = _step(model, ReferenceAttentionBackend(_pool(model)), [a, b], [0, 0], [1, 0])
    torch.testing.assert_close(out_a, _hf_logits(hf, a), rtol=0, atol=ATOL)
    torch.testing.assert_close(out_b, _hf_logits(hf, b), rtol=0, atol=ATOL)


def test_chunked_prefill_then_decode(models: tuple[CausalLM, Any]) -> None:
    model, hf = models
    ids = _prompt(93, model.config.vocab_size, 4)
    ref = _hf_logits(hf, ids)
    backend = ReferenceAttentionBackend(_pool(model))
    bounds = [0, 50, 91, 92, 93]  # two prefill chunks (the first ends mid-page), then two decode steps
    for lo, hi in zip(bounds, bounds[1:]):
        (out,) = _step(model, backend, [ids[lo:hi]], [lo], [3])
        torch.testing.assert_close(out, ref[lo:hi], rtol=0, atol=ATOL, msg=lambda m: f"tokens {lo}:{hi}: {m}")


def test_decode_batch_of_two_with_different_lengths(tiny_checkpoint: Callable[..., Path]) -> None:
    model, hf = _load_pair(tiny_checkpoint, "qwen3-d64-g6")
    a, b = _prompt(40, model.config.vocab_size, 5), _prompt(21, model.config.vocab_size, 6)
    backend = ReferenceAttentionBackend(_pool(model))
    _step(model, backend, [a[:39], b[:20]], [0, 0], [0, 5])
    out_a, out_b = _step(model, backend, [a[39:], b[20:]], [39, 20], [0, 5])
    torch.testing.assert_close(out_a, _hf_logits(hf, a)[39:], rtol=0, atol=ATOL)
    torch.testing.assert_close(out_b, _hf_logits(hf, b)[20:], rtol=0, atol=ATOL)


def test_yarn_override_flag_matches_transformers_yarn(tiny_checkpoint: Callable[..., Path]) -> None:
    """A plain checkpoint + --rope-yarn-factor 4 --rope-original-max-position 32 == the same weights
    with that rope_scaling in config.json (HF oracle)."""
    plain = tiny_checkpoint()
    model = load_model(plain, dtype="fp32", progress=False,
                       rope_overrides={"rope_yarn_factor": 4.0, "rope_original_max_position": 32})
    assert model.rope_params["rope_type"] == "yarn" and model.rotary_emb.attention_factor > 1
    assert model.max_position == 4096  # max(max_position_embeddings, 32 * 4)
    yarn_dir = tiny_checkpoint(**GEOMETRIES["qwen3-yarn"])
    hf = AutoModelForCausalLM.from_pretrained(yarn_dir, dtype=torch.float32).eval()
    same_weights = load_model(yarn_dir, dtype="fp32", progress=False).state_dict()
    assert all(torch.equal(t, same_weights[n]) for n, t in model.state_dict().items())  # only the rope differs
    ids = _prompt(80, model.config.vocab_size, 7)
    (out,) = _step(model, ReferenceAttentionBackend(_pool(model)), [ids], [0], [0])
    torch.testing.assert_close(out, _hf_logits(hf, ids), rtol=0, atol=ATOL)
    # and the override really changed something
    base = load_model(plain, dtype="fp32", progress=False)
    (out_base,) = _step(base, ReferenceAttentionBackend(_pool(base)), [ids], [0], [0])
    assert (out_base - out).abs().max() > 1e-2


def test_bf16_weights_stay_close(tiny_checkpoint: Callable[..., Path]) -> None:
    """bf16 weights: our error against the fp32 oracle is no worse than transformers' own in bf16."""
    _, hf32 = _load_pair(tiny_checkpoint, "qwen3-d64-g6")
    model = load_model(tiny_checkpoint(), dtype="bf16", progress=False)
    assert model.dtype == torch.bfloat16 and model.rotary_emb.inv_freq(torch.device("cpu")).dtype == torch.float32
    hf16 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(), dtype=torch.bfloat16).eval()
    ids = _prompt(60, model.config.vocab_size, 8)
    (out,) = _step(model, ReferenceAttentionBackend(_pool(model)), [ids], [0], [0])
    ref = _hf_logits(hf32, ids)
    hf_err = (_hf_logits(hf16, ids) - ref).abs().max()
    assert (out - ref).abs().max() <= 1.5 * hf_err + 1e-3


@pytest.mark.parametrize("kv_dtype,min_cos", [("int8", 0.999), ("rk4v4-e8", 0.95)])  # measured 0.99978 / 0.9675
def test_quantized_kv_stays_close(tiny_checkpoint: Callable[..., Path], kv_dtype: str, min_cos: float) -> None:
    """The quantized formats run end to end through the reference backend (store -> decode)."""
    model, hf = _load_pair(tiny_checkpoint, "qwen3-d128-g2")
    ids = _prompt(60, model.config.vocab_size, 9)
    pool = _pool(model, kv_dtype)
    (out,) = _step(model, ReferenceAttentionBackend(pool), [ids], [0], [0])
    ref = _hf_logits(hf, ids)
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cos.min() > min_cos, cos.min()
    assert (out - ref).abs().max() > 0  # it is really quantized
    assert pool.layers[0]["k"].dtype == (torch.int8 if kv_dtype == "int8" else torch.uint8)


def test_backend_stores_encoded_kv_and_skips_minus_one() -> None:
    pool = KVCachePool("rk4v4-e8", 1, 2, 64, 4, page_size=PAGE, model_dtype=torch.float32)
    backend = ReferenceAttentionBackend(pool)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    backend.store(0, k, v, torch.tensor([5, -1, 2 * PAGE + 1]))
    data, scale = pool.fmt.encode(k)
    assert torch.equal(pool.layers[0]["k"][0, :, 5], data[0])
    assert torch.equal(pool.layers[0]["k_scale"][2, :, 1], scale[2])
    assert int(pool.layers[0]["k"].count_nonzero()) == int(data[0].count_nonzero() + data[2].count_nonzero())


def test_hidden_shape_dtype_and_tied_embeddings(models: tuple[CausalLM, Any]) -> None:
    """hidden comes back [T, H] in the model dtype; embeddings of a tied model are shared."""
    model, _ = models
    ids = _prompt(5, model.config.vocab_size, 10)
    meta = build_metadata([5], [5], PAGE)
    with torch.no_grad():
        h = model(ids, torch.arange(5), meta, ReferenceAttentionBackend(_pool(model)))
    assert h.shape == (5, model.config.hidden_size) and h.dtype == model.dtype
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_backend_without_host_copies_matches(tiny_checkpoint: Callable[..., Path]) -> None:
    """Metadata without the *_cpu lists (device tensors only) gives the same output."""
    model, _ = _load_pair(tiny_checkpoint, "qwen3-d128-g2")
    cfg = model.config
    q = torch.randn(12, cfg.num_heads, cfg.head_dim)
    k, v = torch.randn(12, cfg.num_kv_heads, cfg.head_dim), torch.randn(12, cfg.num_kv_heads, cfg.head_dim)
    outs = []
    for host in (True, False):
        meta = build_metadata([7, 5], [7, 20], PAGE, [0, 4])
        if not host:
            meta.query_lens_cpu = meta.seq_lens_cpu = None
        outs.append(ReferenceAttentionBackend(_pool(model)).forward(0, q, k, v, meta, 0.125))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
