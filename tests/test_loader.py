"""Checkpoint loading: sharded and single-file give the same weights; every broken directory fails
with an error that names the file and the tensor."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer.model_config import ConfigError
from ninfer.models import CheckpointError, load_model, load_tokenizer

Factory = Callable[..., Path]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_equals_single_file(tiny_checkpoint: Factory) -> None:
    single = tiny_checkpoint()
    sharded = tiny_checkpoint(shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) >= 3
    a = load_model(single, progress=False).state_dict()
    b = load_model(sharded, progress=False).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merged_rows_come_from_the_right_tensors(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, progress=False)
    raw = load_file(str(tiny_model_dir / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split((attn.q_size, attn.kv_size, attn.kv_size))
    assert torch.equal(k, raw["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, raw["model.layers.1.self_attn.v_proj.weight"])
    up = model.model.layers[0].mlp.gate_up_proj.weight[model.config.intermediate_size:]
    assert torch.equal(up, raw["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(attn.k_norm.weight, raw["model.layers.1.self_attn.k_norm.weight"])


@pytest.mark.parametrize("dtype,expected", [("auto", torch.float32), ("bf16", torch.bfloat16),
                                            ("fp16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_dtype(tiny_model_dir: Path, dtype: str, expected: torch.dtype) -> None:
    model = load_model(tiny_model_dir, dtype=dtype, progress=False)
    assert all(p.dtype == expected for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="int4"):
        load_model(tiny_model_dir, dtype="int4", progress=False)


def test_tied_embeddings_without_lm_head(tiny_checkpoint: Factory) -> None:
    path = tiny_checkpoint(tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load_model(path, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_shard_named(tiny_checkpoint: Factory, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint(shards=3), tmp_path / "m")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(path, progress=False)


def test_index_points_at_missing_file(tiny_checkpoint: Factory, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint(shards=3), tmp_path / "m")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-99999-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-99999-of-00003\.safetensors.*model\.norm\.weight"):
        load_model(path, progress=False)


def test_index_places_tensor_in_wrong_shard(tiny_checkpoint: Factory, tmp_path: Path) -> None:
    path = _copy(tiny_checkpoint(shards=3), tmp_path / "m")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[-1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{files[-1]}.*lacks tensor {name}"):
        load_model(path, progress=False)


@pytest.mark.parametrize("keep_bytes", [-100, 20])
def test_truncated_file_named(tiny_model_dir: Path, tmp_path: Path, keep_bytes: int) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    f = path / "model.safetensors"
    os.truncate(f, keep_bytes if keep_bytes > 0 else f.stat().st_size + keep_bytes)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_model(path, progress=False)


def _rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_tensor_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.v_proj\.weight.*"
                                              r"model\.safetensors"):
        load_model(path, progress=False)


def test_wrong_shape_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :-8].contiguous()

    _rewrite(path, shrink)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.down_proj\.weight "
                                              r"has shape \[64, 120\].*\[64, 128\]"):
        load_model(path, progress=False)


def test_unknown_tensors_are_ignored_with_a_warning(tiny_model_dir: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    load_model(path, progress=False)
    assert "model.extra.weight" in caplog.text


def test_no_weights_no_config_unknown_arch(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(path, progress=False)
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path / "nothing", progress=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        load_model(path, progress=False)


def test_tokenizer_and_chat_template(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg["eos_token_id"]
    assert tok.bos_token_id == cfg["bos_token_id"] and len(tok) <= cfg["vocab_size"]
    text = "Hello world, 1234! ünïcödé"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(CheckpointError):
        load_tokenizer(tiny_model_dir / "missing")


def test_rope_overrides_from_engine_config(tiny_model_dir: Path) -> None:
    from ninfer.config import EngineConfig

    model = load_model(tiny_model_dir, progress=False,
                       rope_overrides=EngineConfig(rope_yarn_factor=2.0, rope_original_max_position=4096))
    assert model.rope_params["rope_type"] == "yarn" and model.max_position == 8192
    assert model.config.rope_scaling["factor"] == 2.0
    assert "rope=yarn factor=2.0 original_max_position_embeddings=4096" in model.describe()
    assert load_model(tiny_model_dir, progress=False, rope_overrides=EngineConfig()).rope_params["rope_type"] == "default"
    with pytest.raises(ValueError, match="yarn_factr"):
        load_model(tiny_model_dir, progress=False, rope_overrides={"yarn_factr": 2.0})


def test_runtime_never_imports_the_tools() -> None:
    """engine, kvcache, attention, models, layers and server load without ninfer.tools (the random
    checkpoint writer and the probe trainer are offline tools)."""
    import subprocess
    import sys
    code = ("import sys, ninfer.engine.engine, ninfer.server.app, ninfer.models, ninfer.layers.attention, "
            "ninfer.kvcache.planner; from ninfer.models.registry import ARCHITECTURES, get_model_class; "
            "[get_model_class(a) for a in ARCHITECTURES]; "
            "bad = sorted(m for m in sys.modules if m.startswith(('ninfer.tools', 'ninfer.probe'))); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
