"""Quantization configs: what is refused (one line naming the scheme), misaligned FP8 blocks and
truncated scale tensors refused with their numbers, and the planner's weight bytes equal to what
the loaded model holds."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ninfer import cli
from ninfer.model_config import ModelConfig
from ninfer.models import CheckpointError, load_model
from ninfer.quant import QuantConfigError, parse_quant_config
from ninfer.tools.random_checkpoint import write_random_checkpoint
from tests.test_quant_checkpoints import DENSE, HYBRID

REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq' (4-bit)"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8 per-tensor"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme='static'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size=[64, 64]"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}, "format int-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "without config_groups"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}, "float-quantized group g"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "static input_activations"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}, "group g"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo='FP8'"),
]


@pytest.mark.parametrize("q,named", REFUSED)
def test_unsupported_schemes_are_refused_by_name(q: dict, named: str) -> None:
    with pytest.raises(QuantConfigError) as e:
        parse_quant_config({"quantization_config": q})
    msg = str(e.value)
    assert named in msg and "supported: fp8" in msg and "modelopt NVFP4" in msg and "\n" not in msg


def test_plan_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_random_checkpoint(tmp_path / "awq", DENSE, device="cpu", config_only=True, tokenizer=None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["plan", str(path), "--memory", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'awq'" in err and "Traceback" not in err
    with pytest.raises(QuantConfigError, match="'awq'"):
        load_model(path, progress=False)


def test_misaligned_fp8_parts_are_refused_with_numbers(tmp_path: Path) -> None:
    # head_dim 64 with one KV head: k_proj and v_proj have 64 rows, half a 128-row block
    path = write_random_checkpoint(tmp_path / "m", {**DENSE, "head_dim": 64}, device="cpu", quant="fp8",
                                   tokenizer=None)
    with pytest.raises(QuantConfigError) as e:
        load_model(path, progress=False)
    msg = str(e.value)
    assert "k_proj has 64 rows" in msg and "128" in msg and "q_proj=128" in msg and "\n" not in msg


@pytest.mark.parametrize("quant,tensor", [("fp8", "model.layers.1.mlp.up_proj.weight_scale_inv"),
                                          ("nvfp4", "model.layers.0.self_attn.k_proj.weight_scale"),
                                          ("nvfp4", "model.layers.1.mlp.down_proj.weight_global_scale")])
def test_truncated_scale_tensor_is_refused(tmp_path: Path, quant: str, tensor: str) -> None:
    src = write_random_checkpoint(tmp_path / "src", DENSE, device="cpu", quant=quant, tokenizer=None)
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            t = {k: h.get_tensor(k) for k in h.keys()}
        if tensor in t:
            t[tensor] = t[tensor][:-1] if t[tensor].numel() > 1 else t[tensor][:0]
            save_file(t, str(f))
    with pytest.raises(CheckpointError) as e:
        load_model(dst, progress=False)
    assert tensor in str(e.value) and "needs" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("quant", ["fp8", "fp8-ct", "nvfp4", "nvfp4-modelopt"])
@pytest.mark.parametrize("geom", ["dense", "hybrid"])
def test_planned_weight_bytes_equal_the_loaded_model(tmp_path: Path, quant: str, geom: str) -> None:
    g = DENSE if geom == "dense" else HYBRID
    path = write_random_checkpoint(tmp_path / "c", g, device="cpu", quant=quant, tokenizer=None)
    model = load_model(path, dtype="bf16", progress=False)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = ModelConfig.load(path)
    assert cfg.weight_bytes("bf16") == held
    # against the unquantized count: fp8 is about half of bf16, nvfp4 about a quarter, lm_head and
    # the embedding excepted
    dense = cfg.num_params() * 2
    v, h = cfg.vocab_size, cfg.hidden_size
    linears = dense - 2 * (2 * v * h)
    ratio = (held - 2 * (2 * v * h)) / linears
    lo, hi = (0.5, 0.56) if quant.startswith("fp8") else (0.28, 0.34)
    assert lo < ratio < hi, ratio


def test_modelopt_config_from_hf_quant_config_json(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "mo", DENSE, device="cpu", quant="nvfp4-modelopt", tokenizer=None)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")  # older exports say it only in hf_quant_config.json
    (path / "config.json").write_text(json.dumps(cfg))
    qc = parse_quant_config(ModelConfig.load(path).raw)
    assert qc is not None and qc.layout == "modelopt" and not qc.is_quantized("lm_head")
    model = load_model(path, progress=False)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8


def _rewrite(path: Path, edit) -> None:
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            t = {k: h.get_tensor(k) for k in h.keys()}
        edit(t)
        save_file(t, str(f))


def test_missing_scale_tensor_is_refused(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "c", DENSE, device="cpu", quant="fp8", tokenizer=None)
    name = "model.layers.0.self_attn.v_proj.weight_scale_inv"
    _rewrite(path, lambda t: t.pop(name))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"v_proj.weight is torch.float8_e4m3fn \(quantized\)"):
        load_model(path, progress=False)


def test_tensors_decide_where_the_config_is_silent(tmp_path: Path) -> None:
    """A config that does not exclude lm_head while the file keeps it dense: lm_head loads dense."""
    path = write_random_checkpoint(tmp_path / "c", DENSE, device="cpu", quant="fp8", tokenizer=None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path, dtype="bf16", progress=False)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
