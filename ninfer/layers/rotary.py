"""Rotary position embedding (rotate-half convention of HF Llama/Qwen) with default, linear, llama3
and YaRN frequency scaling.

The parameters come from the config's `rope_scaling` (transformers 4.x) or `rope_parameters`
(transformers 5.x), optionally overridden by `--rope-yarn-factor/--rope-original-max-position`.
inv_freq and the attention factor (YaRN's mscale, which multiplies cos and sin) follow the math of
transformers' `ROPE_INIT_FUNCTIONS` exactly; tests compare them. Scaling is static: the factor does
not depend on the current sequence length (as vLLM applies it)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch

from ninfer.model_config import ConfigError, ModelConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def normalize_rope_params(cfg: ModelConfig) -> dict[str, Any]:
    """One flat dict with `rope_type`, `rope_theta` and the type's own keys, whatever the config era."""
    raw = cfg.raw or {}
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    params.update(cfg.rope_scaling or {})  # ModelConfig already folded non-default rope_parameters in here
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params.pop("type", None)
    params["rope_type"] = rope_type
    params["rope_theta"] = float(params.get("rope_theta") or cfg.rope_theta)
    if "partial_rotary_factor" not in params and raw.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = raw["partial_rotary_factor"]
    if rope_type in ("llama3", "yarn"):
        # transformers gives a top-level original_max_position_embeddings priority, then falls back
        # to max_position_embeddings
        if raw.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = int(raw["original_max_position_embeddings"])
        params.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return params


def apply_rope_overrides(cfg: ModelConfig, yarn_factor: float | None = None,
                         original_max_position: int | None = None) -> ModelConfig:
    """The config with `--rope-yarn-factor F [--rope-original-max-position N]` applied: static YaRN
    with factor F over an original window N (default: the config's own original window, else its
    max_position_embeddings). N alone only re-targets a config that already uses YaRN."""
    if yarn_factor is None and original_max_position is None:
        return cfg
    params = normalize_rope_params(cfg)
    if yarn_factor is None and params["rope_type"] != "yarn":
        raise ConfigError("--rope-original-max-position needs --rope-yarn-factor "
                          f"(the config's rope_type is {params['rope_type']!r}, not yarn)")
    if params["rope_type"] != "yarn":
        # keep only the keys YaRN understands; a previous linear/llama3 setup is replaced
        params = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
        params["rope_type"] = "yarn"
        params["original_max_position_embeddings"] = cfg.max_position_embeddings
    if yarn_factor is not None:
        if not yarn_factor > 0:
            raise ConfigError(f"--rope-yarn-factor must be > 0, got {yarn_factor}")
        params["factor"] = float(yarn_factor)
    if original_max_position is not None:
        params["original_max_position_embeddings"] = int(original_max_position)
    return dataclasses.replace(cfg, rope_scaling=params)


def scaled_max_position(cfg: ModelConfig) -> int:
    """Longest context the (possibly rope-scaled) model is meant for, as vLLM derives it: YaRN =
    original window x factor, linear = max_position_embeddings x factor, llama3 keeps the config's."""
    params = normalize_rope_params(cfg)
    base = cfg.max_position_embeddings
    factor = params.get("factor")
    if params["rope_type"] == "yarn" and factor:
        return max(base, int(params["original_max_position_embeddings"] * factor))
    if params["rope_type"] == "linear" and factor:
        return int(base * factor)
    return base


def rope_dim(params: Mapping[str, Any], head_dim: int) -> int:
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0)))


# inv_freq is always built on the CPU, also when the model is constructed under torch.device("meta")
_CPU = torch.device("cpu")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=_CPU).to(torch.float32) / dim))


def _yarn(params: Mapping[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv 2309.00071): low-frequency dims are interpolated (inv_freq / factor), high-frequency
    # ones extrapolated (unchanged), with a linear ramp between the dims whose wavelength fits
    # beta_fast and beta_slow rotations into the original window.
    theta = params["rope_theta"]
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=_CPU) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1 = keep the original frequency

    pos_freqs = theta ** (torch.arange(0, dim, 2, device=_CPU).to(torch.float32) / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolate) + inv_extra * extrapolate
    return inv_freq, float(attn)


def _llama3(params: Mapping[str, Any], dim: int) -> torch.Tensor:
    # Llama 3.1: wavelengths longer than orig/low_freq_factor are divided by factor, shorter than
    # orig/high_freq_factor kept, and the band between blended smoothly.
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_ff, high_ff = params["low_freq_factor"], params["high_freq_factor"]
    orig = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = orig / low_ff, orig / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(params: Mapping[str, Any], head_dim: int,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim // 2] float32, attention_factor) for normalized rope params."""
    dim = rope_dim(params, head_dim)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return _base_inv_freq(params["rope_theta"], dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(params, dim), 1.0
    if rope_type == "yarn":
        return _yarn(params, dim, max_position_embeddings)
    raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin from positions in float32 (angles of large positions need the mantissa), applied to
    q/k [T, H, D]. inv_freq is a plain float32 tensor, not a buffer, so `model.to(bf16)` cannot
    degrade it; it follows the positions' device."""

    def __init__(self, head_dim: int, params: Mapping[str, Any], max_position_embeddings: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.params = dict(params)
        self.rotary_dim = rope_dim(params, head_dim)
        inv_freq, attention_factor = compute_inv_freq(params, head_dim, max_position_embeddings)
        self.attention_factor = attention_factor
        self._inv_freq = {inv_freq.device: inv_freq}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = next(iter(self._inv_freq.values())).to(device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> cos, sin [T, rotary_dim] float32, attention factor folded in."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"rope_type={self.params['rope_type']}, dim={self.rotary_dim}, attention_factor={self.attention_factor:.6g}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] float32 with R <= D (partial rotary leaves x[..., R:] as is).
    Like transformers, cos/sin are cast to x's dtype and the rotation runs in that dtype."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return torch.cat((rot, x[..., r:]), dim=-1)
