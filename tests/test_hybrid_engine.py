"""The engine on Qwen3.5 hybrids (CPU, fp32, unquantized KV): greedy tokens identical to
transformers' `generate` for a batch of prompts of mixed lengths, longer than a page (64) and
than the step's token budget (chunked prefill sharing steps with decodes, continuing the GDN
state); aborting mid-prefill and mid-decode returns every page and state slot; the planner and
the loaded model agree on the cache spec; prefix reuse is off with its reason."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ninfer import LLM, SamplingParams
from tests.tiny_models import make_hybrid_checkpoint, use_transformers_torch_gdn

use_transformers_torch_gdn()
NEW_TOKENS = 12
PATTERNS = {
    "lf-d128-g2": dict(layer_types=("linear", "full"), heads=4, kv_heads=2, head_dim=128),
    "llfl-d256-g4": dict(layer_types=("linear", "linear", "full", "linear"), heads=4, kv_heads=1, head_dim=256,
                         linear_k_heads=1, linear_v_heads=2),
}
_DIRS: dict[str, Path] = {}


def _ckpt(tmp_path_factory: pytest.TempPathFactory, key: str) -> Path:
    if key not in _DIRS:
        _DIRS[key] = make_hybrid_checkpoint(tmp_path_factory.mktemp("hyb"), **PATTERNS[key])
    return _DIRS[key]


def _llm(path: Path, **kw) -> LLM:
    kw = {"kv_capacity": 2048, "max_context": 512, "max_num_batched_tokens": 48, "max_num_seqs": 4, **kw}
    return LLM(str(path), kv_dtype=kw.pop("kv_dtype", "auto"), device="cpu", dtype="fp32", **kw)


def _prompts(vocab: int = 380) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (150, 70, 9)]


@pytest.mark.parametrize("key", list(PATTERNS))
def test_greedy_tokens_match_transformers_generate(tmp_path_factory, key: str) -> None:
    from transformers import AutoModelForCausalLM
    path = _ckpt(tmp_path_factory, key)
    llm = _llm(path)
    assert any("prefix reuse: off" in line for line in llm.engine.startup_lines)
    assert "gdn_kernels=torch" in llm.engine.startup_lines[0]
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref, f"prompt of {len(prompt)}: {out.token_ids} vs transformers {ref}"


def test_abort_mid_prefill_and_mid_decode_frees_pages_and_state_slots(tmp_path_factory) -> None:
    llm = _llm(_ckpt(tmp_path_factory, "lf-d128-g2"))
    eng = llm.engine
    bm = eng.block_manager
    pages, slots = bm.num_free_pages, bm.num_free_slots
    assert slots == 4
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    long_p, short_p = _prompts()[0], _prompts()[2]
    eng.add_request("short", short_p, params)
    eng.add_request("long", long_p, params)   # 150 tokens at <= 48 per step: several prefill steps
    eng.step()
    eng.step()
    long_req = eng.scheduler.requests["long"]
    assert bm.num_free_slots == 2 and 0 < long_req.num_computed_tokens < len(long_p)
    eng.abort_request("long")                 # mid-prefill
    for _ in range(3):
        eng.step()                            # "short" decodes
    eng.abort_request("short")                # mid-decode
    eng.step()
    assert not eng.has_unfinished_requests()
    assert (bm.num_free_pages, bm.num_free_slots) == (pages, slots)
    # a slot reused after an abort starts from zeros: the same prompt gives the same tokens again
    first = llm.generate([short_p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    again = llm.generate([short_p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert first[0].token_ids == again[0].token_ids


def test_planner_and_model_agree_on_the_cache_spec(tmp_path_factory) -> None:
    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.planner import default_cache_spec
    from ninfer.models import load_model
    path = _ckpt(tmp_path_factory, "llfl-d256-g4")
    model = load_model(path, dtype="fp32", progress=False)
    for kv in ("int8", "rk4v4-e8"):
        spec = model.cache_specs(get_format(kv))
        assert spec == default_cache_spec(model.config, kv)  # `ninfer plan` / bench plans see the states too
        assert spec.num_kv_layers == 1 and len(spec.state_specs) == 3
    m = model.linear_layers()[0]
    assert spec.state_bytes_per_seq() == 3 * 4 * (3 * m.conv_dim + m.hv * m.dk * m.dv)


def test_hybrid_preset_checkpoint_is_what_transformers_loads(tmp_path: Path) -> None:
    """The random checkpoint writer's tiny-hybrid preset: every tensor transformers'
    Qwen3_5ForCausalLM expects, nothing else, and our logits equal its logits."""
    from transformers import AutoModelForCausalLM

    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.pool import KVCachePool
    from ninfer.models import load_model
    from ninfer.tools.random_checkpoint import main
    from tests.tiny_models import build_metadata
    out = tmp_path / "tiny-hybrid"
    assert main(["--preset", "tiny-hybrid", "--out", str(out), "--device", "cpu", "--dtype", "fp32",
                 "--tokenizer-from", "byte", "--std", "0.1"]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = load_model(out, dtype="fp32", progress=False)
    assert model.config.num_kv_layers == 2 and len(model.linear_layers()) == 6
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=torch.Generator().manual_seed(0))
    pool = KVCachePool.from_spec(model.cache_specs(get_format("auto")), 4, 1, "cpu", model.dtype)
    meta = build_metadata([80], [80])
    meta.state_slots, meta.has_initial_state = torch.tensor([0], dtype=torch.int32), torch.tensor([False])
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(80), meta, ReferenceAttentionBackend(pool)))
        ref = hf.eval()(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


def test_tiny_preset_with_default_tokenizer_and_bad_vocab(tmp_path: Path, capsys) -> None:
    """The tiny preset's vocabulary cannot hold the probe's tokenizer: the default picks the byte-level one;
    a vocabulary too small for any tokenizer is refused in one line, no traceback."""
    from ninfer.tools.random_checkpoint import main
    out = tmp_path / "tiny"
    assert main(["--preset", "tiny-hybrid", "--out", str(out), "--device", "cpu", "--config-only"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) <= cfg["vocab_size"]
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny-hybrid", "--out", str(tmp_path / "bad"), "--device", "cpu", "--config-only",
              "--set", "vocab_size=100"])
    assert "vocab_size=100 is smaller than the tokenizer's" in str(e.value) and "\n" not in str(e.value)
