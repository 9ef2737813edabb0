"""RoPE against transformers: inv_freq and attention factor of every scaling type (from its
ROPE_INIT_FUNCTIONS / the models' default init), cos/sin and the rotate-half application."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from ninfer.model_config import ConfigError, ModelConfig
from ninfer.layers.rotary import (RotaryEmbedding, apply_rope_overrides, apply_rotary, compute_inv_freq,
                                normalize_rope_params, scaled_max_position)

CASES = [
    # (head_dim, theta, max_position, rope params without rope_theta)
    (64, 10000.0, 2048, {"rope_type": "default"}),
    (128, 1e6, 40960, {"rope_type": "default"}),
    (64, 10000.0, 2048, {"rope_type": "linear", "factor": 2.0}),
    (128, 5e5, 8192, {"rope_type": "linear", "factor": 4.5}),
    (128, 5e5, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}),
    (64, 5e5, 131072, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}),
    (128, 1e6, 131072, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    (256, 1e7, 262144, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768,
                        "beta_fast": 16, "beta_slow": 2}),
    (64, 10000.0, 8192, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                         "mscale": 0.707, "mscale_all_dim": 1.0}),
    (128, 1e6, 65536, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768,
                       "attention_factor": 1.25, "truncate": False}),
    (64, 10000.0, 4096, {"rope_type": "yarn", "factor": 16.0}),  # original window defaults to max_position
]


def _hf_config(head_dim: int, theta: float, max_pos: int, params: dict) -> Qwen3Config:
    return Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_parameters={**params, "rope_theta": theta})


def _hf_inv_freq(cfg: Qwen3Config) -> tuple[torch.Tensor, float]:
    rope_type = cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        return Qwen3RotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]['rope_type']}-d{c[0]}")
def test_inv_freq_and_attention_factor_match_transformers(case: tuple) -> None:
    head_dim, theta, max_pos, params = case
    hf_cfg = _hf_config(head_dim, theta, max_pos, params)
    ref_inv, ref_attn = _hf_inv_freq(hf_cfg)
    ours = ModelConfig.from_dict(hf_cfg.to_dict())
    inv, attn = compute_inv_freq(normalize_rope_params(ours), ours.head_dim, ours.max_position_embeddings)
    assert inv.dtype == torch.float32
    torch.testing.assert_close(inv, ref_inv.float(), rtol=0, atol=0)
    assert attn == pytest.approx(ref_attn, rel=1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if c[3]["rope_type"] != "default"],
                         ids=lambda c: f"{c[3]['rope_type']}-d{c[0]}")
def test_transformers4_rope_scaling_spelling(case: tuple) -> None:
    """config.json of the transformers-4 era: rope_scaling with "type" and a top-level rope_theta."""
    head_dim, theta, max_pos, params = case
    ref_inv, ref_attn = _hf_inv_freq(_hf_config(head_dim, theta, max_pos, params))
    legacy = {k: v for k, v in params.items() if k != "rope_type"} | {"type": params["rope_type"]}
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10,
                                 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "head_dim": head_dim, "rope_theta": theta,
                                 "max_position_embeddings": max_pos, "rope_scaling": legacy})
    inv, attn = compute_inv_freq(normalize_rope_params(cfg), head_dim, max_pos)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=0, atol=0)
    assert attn == pytest.approx(ref_attn, rel=1e-12)


@pytest.mark.parametrize("factor,orig", [(4.0, None), (4.0, 1024), (2.5, 8192)])
def test_yarn_override_flags(factor: float, orig: int | None) -> None:
    """--rope-yarn-factor F [--rope-original-max-position N] == a config that says yarn F N."""
    hf_plain = _hf_config(128, 1e6, 4096, {"rope_type": "default"})
    cfg = apply_rope_overrides(ModelConfig.from_dict(hf_plain.to_dict()), factor, orig)
    expected = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig or 4096}
    ref_inv, ref_attn = _hf_inv_freq(_hf_config(128, 1e6, 4096, expected))
    params = normalize_rope_params(cfg)
    inv, attn = compute_inv_freq(params, 128, cfg.max_position_embeddings)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=0, atol=0)
    assert attn == pytest.approx(0.1 * math.log(factor) + 1) and attn == pytest.approx(ref_attn)
    assert scaled_max_position(cfg) == max(4096, int((orig or 4096) * factor))


def test_override_retargets_existing_yarn_and_refuses_without_factor() -> None:
    yarn = ModelConfig.from_dict(_hf_config(64, 1e6, 40960, {"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 32768}).to_dict())
    assert scaled_max_position(yarn) == 131072
    moved = apply_rope_overrides(yarn, None, 16384)
    assert normalize_rope_params(moved)["original_max_position_embeddings"] == 16384
    assert normalize_rope_params(moved)["factor"] == 4.0
    plain = ModelConfig.from_dict(_hf_config(64, 1e6, 4096, {"rope_type": "default"}).to_dict())
    assert apply_rope_overrides(plain) is plain
    with pytest.raises(ConfigError, match="rope-yarn-factor"):
        apply_rope_overrides(plain, None, 1024)
    linear = ModelConfig.from_dict(_hf_config(64, 1e4, 2048, {"rope_type": "linear", "factor": 2.0}).to_dict())
    assert scaled_max_position(linear) == 4096


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_type_is_refused(rope_type: str) -> None:
    cfg = ModelConfig.from_dict({"vocab_size": 8, "hidden_size": 64, "intermediate_size": 64,
                                 "num_hidden_layers": 1, "num_attention_heads": 1,
                                 "rope_scaling": {"rope_type": rope_type, "factor": 2.0}})
    with pytest.raises(ConfigError, match=rope_type):
        normalize_rope_params(cfg)


@pytest.mark.parametrize("params", [{"rope_type": "default"},
                                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
                                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 512}],
                         ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cos_sin_and_apply_match_transformers(params: dict, dtype: torch.dtype) -> None:
    hf_cfg = _hf_config(128, 1e6, 4096, params)
    hf_rope = Qwen3RotaryEmbedding(hf_cfg)
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    ours = RotaryEmbedding(cfg.head_dim, normalize_rope_params(cfg), cfg.max_position_embeddings)
    # positions of a long context too: the angles must be computed in float32 like transformers
    positions = torch.cat([torch.arange(0, 50), torch.tensor([4095, 65_537, 1_000_003])])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 6, 128, generator=g).to(dtype)
    k = torch.randn(len(positions), 2, 128, generator=g).to(dtype)
    hf_cos, hf_sin = hf_rope(q, positions[None])
    cos, sin = ours.cos_sin(positions)
    assert cos.dtype == torch.float32
    torch.testing.assert_close(cos.to(dtype), hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin.to(dtype), hf_sin[0], rtol=0, atol=0)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, hf_cos[0], hf_sin[0], unsqueeze_dim=1)
    out_q, out_k = ours(positions, q, k)
    assert out_q.dtype == dtype
    torch.testing.assert_close(out_q, ref_q, rtol=0, atol=0)
    torch.testing.assert_close(out_k, ref_k, rtol=0, atol=0)


def test_partial_rotary_leaves_the_tail() -> None:
    x = torch.randn(5, 2, 64)
    cos, sin = torch.ones(5, 32), torch.zeros(5, 32)
    torch.testing.assert_close(apply_rotary(x, cos, sin), x)
    cos, sin = torch.zeros(5, 32), torch.ones(5, 32)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[..., 32:], x[..., 32:])
    torch.testing.assert_close(out[..., :16], -x[..., 16:32])


def test_llama_config_default_head_dim() -> None:
    """head_dim absent from config.json: hidden // heads, as transformers derives it."""
    hf_cfg = LlamaConfig(hidden_size=96, num_attention_heads=3, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 5e5})
    ref_inv, _ = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    d = hf_cfg.to_dict()
    d.pop("head_dim", None)
    cfg = ModelConfig.from_dict(d)
    inv, _ = compute_inv_freq(normalize_rope_params(cfg), cfg.head_dim, cfg.max_position_embeddings)
    torch.testing.assert_close(inv, ref_inv, rtol=0, atol=0)
