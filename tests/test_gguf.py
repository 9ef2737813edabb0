"""GGUF checkpoints: a tiny HF checkpoint (written by transformers) is exported the way llama.cpp's
converter does it (its tensor names, the Q/K row permutation for `llama`, tokenizer and chat
template in the metadata, Q8_0 or F32 blocks written by gguf's own quantizer); ninfer's converter
must give back the HF tensors, tokenizer and config, and the engine must then generate what
transformers generates from the original. Unsupported files fail with one line."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's export order for llama q/k rows: per head, (2, half) -> (half, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(ckpt: Path, out: Path, qtype: str = "F32", arch: str | None = None) -> Path:
    from safetensors.torch import load_file
    cfg = json.loads((ckpt / "config.json").read_text())
    arch = arch or cfg["model_type"]
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tcfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(specials[tcfg["eos_token"]])
    w.add_bos_token_id(specials[tcfg["bos_token"]])
    w.add_add_bos_token(False)
    template = (ckpt / "chat_template.jinja")
    w.add_chat_template(template.read_text() if template.is_file() else tcfg["chat_template"])
    state = load_file(str(ckpt / "model.safetensors"))
    for name, t in state.items():
        x = t.float().numpy()
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}.get(name)
        if g is None:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
            g = f"blk.{m.group(1)}.{_NAMES[m.group(2)]}.{m.group(3)}"
            if arch == "llama" and m.group(2) == "self_attn.q_proj":
                x = _permute(x, cfg["num_attention_heads"])
            elif arch == "llama" and m.group(2) == "self_attn.k_proj":
                x = _permute(x, cfg["num_key_value_heads"])
        if qtype == "Q8_1" and x.ndim == 2:  # a block type gguf cannot dequantize: raw bytes of its size
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
            w.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        elif qtype != "F32" and x.ndim == 2:
            q = gguf.GGMLQuantizationType[qtype]
            raw = gguf.quants.quantize(x, q)
            w.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=q)
        else:
            w.add_tensor(g, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("qwen3", 1), ("qwen2", 2)])
def test_roundtrip_tensors_config_tokenizer(tiny_checkpoint, tmp_path: Path, arch: str, seed: int) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from ninfer.checkpoints import resolve_model
    ckpt = tiny_checkpoint(arch=arch, hidden=128 if arch == "qwen2" else 64, heads=4, kv_heads=2, head_dim=32,
                           seed=seed)
    out = resolve_model(export_gguf(ckpt, tmp_path / f"{arch}.gguf"))
    assert resolve_model(tmp_path / f"{arch}.gguf") == out            # cached: same directory
    want, got = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    want.pop("lm_head.weight", None) if "lm_head.weight" not in got else None
    assert set(got) == set(want)
    for name in want:  # fp16 storage of F32 values: half-precision rounding only
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=1e-3, atol=1e-4, msg=name)
    from ninfer.model_config import ModelConfig
    a, b = ModelConfig.load(ckpt), ModelConfig.load(out)
    for k in ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
              "intermediate_size", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "rope_theta"):
        assert getattr(a, k) == getattr(b, k), k
    assert b.rms_norm_eps == pytest.approx(a.rms_norm_eps, rel=1e-6)
    ta, tb = AutoTokenizer.from_pretrained(str(ckpt)), AutoTokenizer.from_pretrained(str(out))
    for text in ("The quick brown fox, 7421 times!", "def main():\n    print('hi')", "<|im_start|>user\nhi"):
        assert ta(text).input_ids == tb(text).input_ids, text
    chat = [{"role": "user", "content": "hello"}]
    assert (ta.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == tb.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert tb.eos_token == ta.eos_token


def test_quantized_gguf_dequantizes_like_gguf_and_generates_like_transformers(tiny_checkpoint,
                                                                              tmp_path: Path) -> None:
    """Q8_0 blocks: ninfer's weights are gguf's own dequantization of them; greedy tokens from the
    engine equal transformers' on the converted directory."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ninfer import LLM, SamplingParams
    from ninfer.checkpoints import gguf as conv
    ckpt = tiny_checkpoint(arch="llama", hidden=64, heads=4, kv_heads=2, head_dim=32, seed=3)
    path = export_gguf(ckpt, tmp_path / "q8.gguf", qtype="Q8_0")
    out = conv.convert_cached(path)
    got = load_file(str(out / "model.safetensors"))
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type)
    torch.testing.assert_close(got["model.layers.0.mlp.up_proj.weight"].float(),
                               torch.from_numpy(ref).half().float())
    llm = LLM(str(path), kv_dtype="auto", device="cpu", dtype="fp32", max_context=256, kv_capacity=1024)
    prompt = list(range(5, 40))
    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert list(ours.token_ids) == ref_ids


def test_unsupported_architecture_and_quant_fail_with_one_line(tiny_checkpoint, tmp_path: Path) -> None:
    from ninfer.checkpoints import resolve_model
    ckpt = tiny_checkpoint(arch="llama", hidden=64, heads=4, kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported; supported: llama") as e:
        resolve_model(export_gguf(ckpt, tmp_path / "m.gguf", arch="mamba"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"stored as Q8_1, which this converter cannot dequantize") as e:
        resolve_model(export_gguf(ckpt, tmp_path / "q81.gguf", qtype="Q8_1"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model(bad)
    assert not any((tmp_path / "cache" / "gguf").glob("*/config.json"))  # nothing half-converted was cached
