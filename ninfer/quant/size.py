"""Weight bytes of a quantized checkpoint from its config alone (the planner's weights term):
every linear the checkpoint quantizes at its packed size plus scales, the rest (embeddings, norms,
convolutions, biases, ignored linears) at the activation dtype."""
from __future__ import annotations

import math
from typing import Iterator

from ninfer.quant.config import FP8_BLOCK, NVFP4_GROUP, QuantConfig


def linear_shapes(cfg) -> Iterator[tuple[str, int, int]]:
    """(checkpoint module name, out_features, in_features) of every linear a ModelConfig describes."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    gated = cfg.model_type.startswith("qwen3_5")
    full = set(cfg.full_attention_layers)
    r = cfg.raw
    root = "model.language_model." if cfg.architecture.endswith("ForConditionalGeneration") else "model."
    for n in range(cfg.num_layers):
        p = f"{root}layers.{n}."
        if n in full:
            yield from ((p + "self_attn.q_proj", q * (2 if gated else 1), h), (p + "self_attn.k_proj", kv, h),
                        (p + "self_attn.v_proj", kv, h), (p + "self_attn.o_proj", h, q))
        else:
            kd = int(r["linear_num_key_heads"]) * int(r["linear_key_head_dim"])
            hv = int(r["linear_num_value_heads"])
            vd = hv * int(r["linear_value_head_dim"])
            a = p + "linear_attn."
            yield from ((a + "in_proj_qkv", 2 * kd + vd, h), (a + "in_proj_z", vd, h), (a + "in_proj_b", hv, h),
                        (a + "in_proj_a", hv, h), (a + "out_proj", h, vd))
        yield from ((p + "mlp.gate_proj", i, h), (p + "mlp.up_proj", i, h), (p + "mlp.down_proj", h, i))
    if not cfg.tie_word_embeddings:
        yield "lm_head", cfg.vocab_size, h


def quantized_bytes(qc: QuantConfig, rows: int, cols: int) -> int:
    """Bytes one quantized linear [rows, cols] occupies: fp8 1 B + an fp32 scale per 128x128 block;
    nvfp4 1/2 B + an fp8 scale per 16 columns + an fp32 global scale."""
    if qc.method == "fp8":
        return rows * cols + 4 * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)
    return rows * cols // 2 + rows * cols // NVFP4_GROUP + 4


def weight_bytes(cfg, qc: QuantConfig, act_bytes: int) -> int:
    total = cfg.num_params() * act_bytes
    for name, rows, cols in linear_shapes(cfg):
        if qc.is_quantized(name):
            total += quantized_bytes(qc, rows, cols) - rows * cols * act_bytes
    return total
