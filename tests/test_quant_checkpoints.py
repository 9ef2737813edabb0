"""Quantized checkpoints written by random_checkpoint --quant: their weights against independent
dequantizers (compressed-tensors' own for NVFP4, float64 for FP8 block scales), and the engine's
greedy tokens on them against the same model with the dequantized weights saved densely."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ninfer.engine.llm import LLM
from ninfer.engine.sampling import SamplingParams
from ninfer.models import load_model
from ninfer.quant import QuantLinear
from ninfer.quant.config import FP8_BLOCK
from ninfer.tools.random_checkpoint import write_random_checkpoint

# Dense: merged q|k|v and gate|up parts are multiples of the 128-row FP8 block.
DENSE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=128, vocab_size=512)
HYBRID = dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=512, partial_rotary_factor=0.25,
              full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
              linear_value_head_dim=32, linear_conv_kernel_dim=4)
_CACHE: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")

    def get(quant: str | None, seed: int = 0, geom: str = "dense") -> Path:
        key = (quant, seed, geom)
        if key not in _CACHE:
            _CACHE[key] = write_random_checkpoint(root / f"{geom}-{quant}-{seed}", DENSE if geom == "dense" else HYBRID,
                                                  device="cpu", seed=seed, quant=quant, tokenizer=None)
        return _CACHE[key]
    return get


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def ct_dequant(packed: torch.Tensor, scale: torch.Tensor, gscale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """compressed-tensors' decompressor (fp32 for dtype=float32: its own unpack and dequantize)."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    if dtype == torch.bfloat16:
        return NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale,
                                                 "weight_global_scale": gscale}, scheme)["weight"]
    q = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
    return dequantize(x_q=q, scale=scale.float(), args=scheme.weights, global_scale=gscale, dtype=torch.float32)


def fp8_dequant64(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    full = s.double().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return w.double() * full


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized checkpoint with its linears dequantized by the oracles, fp32."""
    t = _tensors(path)
    out = {}
    for name, v in t.items():
        mod, _, kind = name.rpartition(".")
        if kind == "weight_scale_inv" or (kind == "weight_scale" and getattr(t.get(f"{mod}.weight"), "dtype", None) == torch.float8_e4m3fn):
            out[f"{mod}.weight"] = fp8_dequant64(t[f"{mod}.weight"], v).float()
        elif kind == "weight_packed":
            out[f"{mod}.weight"] = ct_dequant(v, t[f"{mod}.weight_scale"], t[f"{mod}.weight_global_scale"])
        elif kind == "weight_scale_2":  # ModelOpt: the compressed-tensors global scale is its inverse
            out[f"{mod}.weight"] = ct_dequant(t[f"{mod}.weight"], t[f"{mod}.weight_scale"], 1.0 / v.reshape(1))
        elif kind == "weight" and v.dtype in (torch.float8_e4m3fn, torch.uint8):
            continue
        elif kind not in ("weight_scale", "weight_global_scale"):
            out.setdefault(name, v.float())
    return out


def dense_copy(path: Path, dst: Path) -> Path:
    """The quantized checkpoint as a plain fp32 one holding the dequantized weights."""
    dst.mkdir()
    for f in path.iterdir():
        if f.suffix == ".json" and f.name not in ("model.safetensors.index.json", "hf_quant_config.json"):
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(reference_weights(path), str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("quant", ["nvfp4", "nvfp4-modelopt"])
def test_nvfp4_equals_compressed_tensors_decompressor(ckpt, quant: str) -> None:
    path, dense = ckpt(quant), _tensors(ckpt(None))
    model = load_model(path, dtype="fp32", progress=False)
    t = _tensors(path)
    attn, mlp = model.model.layers[1].self_attn.qkv_proj, model.model.layers[0].mlp.gate_up_proj
    for mod, parts in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
        assert isinstance(mod, QuantLinear)
        prefix = "model.layers.1.self_attn." if mod is attn else "model.layers.0.mlp."
        oracle32, oracle16, original = [], [], []
        for p in parts:
            m = prefix + p
            packed = t[f"{m}.weight_packed"] if quant == "nvfp4" else t[f"{m}.weight"]
            g = t[f"{m}.weight_global_scale"] if quant == "nvfp4" else 1.0 / t[f"{m}.weight_scale_2"].reshape(1)
            assert packed.dtype == torch.uint8 and t[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn
            oracle32.append(ct_dequant(packed, t[f"{m}.weight_scale"], g))
            oracle16.append(ct_dequant(packed, t[f"{m}.weight_scale"], g, torch.bfloat16).float())
            original.append(dense[f"{m}.weight"].float())
        ours = mod.dequantized(torch.float32)
        torch.testing.assert_close(ours, torch.cat(oracle32), rtol=1e-6, atol=0)
        torch.testing.assert_close(ours, torch.cat(oracle16), rtol=2 ** -7, atol=0)  # CT computes it in bf16
        # and it is a 4-bit rounding of the same random weights: error well under the weights' spread
        orig = torch.cat(original)
        rel = ((ours - orig).norm() / orig.norm()).item()
        assert 0.01 < rel < 0.15, rel


def test_fp8_block_scales_against_float64(ckpt) -> None:
    t, dense = _tensors(ckpt("fp8")), _tensors(ckpt(None))
    names = [n[: -len(".weight_scale_inv")] for n in t if n.endswith(".weight_scale_inv")]
    assert len(names) == 2 * 7 and "lm_head.weight" in t and t["lm_head.weight"].dtype == torch.bfloat16
    for m in names:
        w = dense[f"{m}.weight"].double()
        q, s = t[f"{m}.weight"], t[f"{m}.weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        n, k = w.shape
        pad = torch.nn.functional.pad(w, (0, -k % FP8_BLOCK, 0, -n % FP8_BLOCK)).abs()
        amax = pad.reshape(pad.shape[0] // FP8_BLOCK, FP8_BLOCK, -1, FP8_BLOCK).amax(dim=(1, 3))
        assert torch.equal(s, (amax / 448.0).float())  # fp32 division of exact values is correctly rounded
        err = (fp8_dequant64(q, s) - w).abs()
        step = s.double().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
        assert bool((err <= w.abs() * 2.0 ** -4 + step * 2.0 ** -10).all()), m  # half an e4m3 step


def test_fp8_block_equals_compressed_tensors_decompressor(ckpt) -> None:
    """The float-quantized FP8_BLOCK layout, through compressed-tensors' own decompressor."""
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import FP8_BLOCK as CT_FP8_BLOCK
    path = ckpt("fp8-ct")
    model, t = load_model(path, dtype="fp32", progress=False), _tensors(path)
    scheme = QuantizationScheme(targets=["Linear"], **CT_FP8_BLOCK)
    gu = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gu, QuantLinear) and gu.qc.layout == "ct-fp8"
    parts = [FloatQuantizationCompressor.decompress({"weight": t[f"model.layers.0.mlp.{p}.weight"],
                                                     "weight_scale": t[f"model.layers.0.mlp.{p}.weight_scale"]},
                                                    scheme)["weight"].float() for p in ("gate_proj", "up_proj")]
    torch.testing.assert_close(gu.dequantized(torch.float32), torch.cat(parts), rtol=1e-6, atol=0)


def test_merged_rows_hold_their_parts(ckpt) -> None:
    """The packed weight and scales of q|k|v and gate|up are the parts' row blocks in order."""
    path = ckpt("fp8")
    model, t = load_model(path, dtype="fp32", progress=False), _tensors(path)
    gu = model.model.layers[1].mlp.gate_up_proj
    assert torch.equal(gu.weight.view(torch.uint8), torch.cat(
        [t[f"model.layers.1.mlp.{p}.weight"] for p in ("gate_proj", "up_proj")]).view(torch.uint8))
    assert torch.equal(gu.weight_scale_inv, torch.cat([t[f"model.layers.1.mlp.{p}.weight_scale_inv"]
                                                       for p in ("gate_proj", "up_proj")]))


def _greedy(path: Path, prompts: list[list[int]], n: int = 8, device: str = "cpu",
            kv_dtype: str = "auto") -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(str(path), kv_dtype=kv_dtype, device=device, dtype="fp32" if device == "cpu" else "bf16",
              max_context=256, kv_capacity=1024)
    rows: dict[str, list[torch.Tensor]] = {}
    llm.engine.logits_hook = lambda reqs, logits: [rows.setdefault(r.request_id, []).append(x.clone())
                                                   for r, x in zip(reqs, logits)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    if kv_dtype != "auto":
        assert "kv centring: on" in "\n".join(llm.engine.startup_lines)
    return [o.token_ids for o in outs], [torch.stack(rows[o.request_id]) for o in outs]


@pytest.mark.parametrize("quant,seed,geom", [("fp8", 0, "dense"), ("fp8", 1, "dense"), ("fp8-ct", 2, "dense"),
                                             ("nvfp4", 0, "dense"),
                                             ("nvfp4", 2, "dense"), ("nvfp4-modelopt", 1, "dense"),
                                             ("fp8", 3, "hybrid"), ("nvfp4", 4, "hybrid")])
def test_greedy_equals_dequantized_checkpoint(ckpt, tmp_path: Path, quant: str, seed: int, geom: str) -> None:
    path = ckpt(quant, seed, geom)
    ref = dense_copy(path, tmp_path / "dense")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 19)]
    tokens, logits = _greedy(path, prompts)
    ref_tokens, ref_logits = _greedy(ref, prompts)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if geom == "hybrid":  # the GDN in-projection: qkv|z packed, the small b|a rows dense
        m = load_model(path, dtype="fp32", progress=False).model.layers[0].linear_attn.in_proj
        assert isinstance(m, QuantLinear) and m.dense_weight is not None and m.dense_weight.shape[0] == 2 * 4


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_quantized_weights_with_centred_quantized_kv(ckpt, tmp_path: Path, quant: str) -> None:
    """Key centring (on by default for quantized KV) installs on a model whose projections are
    QuantLinear, and the tokens equal the dequantized checkpoint's with the same KV format."""
    path = ckpt(quant, 5, "dense")
    ref = dense_copy(path, tmp_path / "dense")
    prompts = [list(range(3, 40)), list(range(60, 71))]
    tokens, logits = _greedy(path, prompts, kv_dtype="rk4v4-e8")
    ref_tokens, ref_logits = _greedy(ref, prompts, kv_dtype="rk4v4-e8")
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
