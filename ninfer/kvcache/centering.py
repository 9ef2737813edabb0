"""Key centring and per-channel smoothing before KV quantization (exact in real arithmetic).

A query's attention scores q.k_i all move by the same q.m when a fixed vector m is taken off every
key of a head, so softmax does not change; scaling key channel c by 1/s_c and the query's channel
c by s_c leaves every q.k unchanged too. So each attention layer stores and attends

    k' = (k - m) / s      q' = q * s          (after RoPE and q/k norm, per kv head; q per group)

with m and s fixed per (layer, kv head, channel). Real keys carry large per-channel offsets and a
few wide channels; both inflate the absmax scale of every 64-group, so k' quantizes with a much
smaller error (docs/KERNELS.md, codec section, has the measurements). Values are NOT centred:
attention-sink tokens take most of the probability with a value near 0, stored almost exactly;
taking the mean off moves them away from 0 and raised KL in the measurements.

m and s must be the same for every key the attention ever sees (fresh chunks, cached pages,
shared prefix pages, every sequence), so they are calibrated once at startup, deterministically:
one forward pass over a shipped passage with unquantized attention (``calibrate``), before any
request and before CUDA graphs are captured (the tensors are static from then on).
    m_c = (max_t k_tc + min_t k_tc) / 2, s_c = r_c^ALPHA / geomean(r^ALPHA), r_c = max_t |k_tc - m_c|
over the passage's tokens after the first (the first token is an attention sink with keys unlike
the rest).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ninfer.attention.base import BaseAttentionBackend, StepMetadata

PASSAGE = Path(__file__).resolve().parents[1] / "bench" / "data" / "bread.txt"
TOKENS = 256   # calibration tokens
ALPHA = 0.5    # smoothing strength (0: centring only)
SKIP = 1       # leading tokens left out of the statistics (the attention sink)


class KeyTransform:
    """q, k -> q * s, (k - m) / s for one attention layer; the tensors are fixed buffers (CUDA graphs
    replay them), in the model's dtype. shift, key_scale [Hkv, D]; query_scale [Hq, D]. This torch
    path is the CPU's and the reference; on CUDA the layers hand the tensors to the fused
    ``qk_norm_rope`` kernel, which rounds every op as these do (bit-equal)."""

    def __init__(self, shift: torch.Tensor, scale: torch.Tensor, num_heads: int) -> None:
        self.shift = shift
        self.key_scale = 1.0 / scale
        self.query_scale = scale.repeat_interleave(num_heads // scale.shape[0], dim=0)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q * self.query_scale, (k - self.shift) * self.key_scale

    def fused_args(self) -> dict[str, torch.Tensor]:
        """The same transform as ``qk_norm_rope``'s keywords (applied after RoPE, rounded as here)."""
        return {"q_scale": self.query_scale, "k_shift": self.shift, "k_scale": self.key_scale}


def key_statistics(keys: torch.Tensor, alpha: float = ALPHA, skip: int = SKIP) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [T, Hkv, D] of one layer -> (m, s) float64 [Hkv, D] (module docstring)."""
    k = keys[skip:].double()
    if k.shape[0] < 1:
        raise ValueError(f"key calibration needs more than {skip} token(s), got {keys.shape[0]}")
    m = (k.amax(0) + k.amin(0)) / 2
    r = (k - m).abs().amax(0).clamp_min(1e-6 * float(k.abs().max().clamp_min(1e-30))) ** alpha
    return m, r / r.log().mean(-1, keepdim=True).exp()


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that call the attention backend (they have ``kv_layer`` and ``key_transform``)."""
    return [m for m in model.modules() if hasattr(m, "kv_layer") and hasattr(m, "key_transform")]


def install(model: torch.nn.Module, stats: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
    """Give every attention layer its KeyTransform from stats (kv_layer -> (m, s)); None removes them."""
    # the activation dtype: the embedding's (a quantized checkpoint's projections hold codes and scales)
    act = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    for mod in attention_layers(model):
        if stats is None:
            mod.key_transform = None
            continue
        m, s = stats[mod.kv_layer]
        dev, dt = act.weight.device, act.weight.dtype
        mod.key_transform = KeyTransform(m.to(dev, dt), s.to(dev, dt), mod.num_heads)


class _Recorder(BaseAttentionBackend):
    """Causal attention over one sequence's chunk, no cache, keeping each layer's keys; recurrent
    layers use the pool's state slot 0 (calibration runs before any request exists)."""
    name = "calibration"

    def __init__(self, pool) -> None:
        self.pool = pool
        self.keys: dict[int, torch.Tensor] = {}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMetadata,
                scale: float) -> torch.Tensor:
        self.keys[layer] = k.float().cpu()
        g = q.shape[1] // k.shape[1]
        t = lambda x: x.transpose(0, 1).float()  # noqa: E731
        out = F.scaled_dot_product_attention(t(q), t(k.repeat_interleave(g, 1)), t(v.repeat_interleave(g, 1)),
                                             is_causal=True, scale=scale)
        return out.transpose(0, 1).to(q.dtype)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, ids: list[int], pool, device: torch.device
              ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One forward pass of ``model`` over the token ids with unquantized, uncentred attention ->
    kv_layer -> (m, s). The model's own transforms are off meanwhile."""
    if len(ids) <= SKIP:
        raise ValueError(f"key calibration text has {len(ids)} token(s); it needs more than {SKIP}")
    n = len(ids)
    saved = [(mod, mod.key_transform) for mod in attention_layers(model)]
    install(model, None)
    rec = _Recorder(pool)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    meta = StepMetadata(slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
                        query_start_loc=i32([0, n]), seq_lens=i32([n]), block_tables=i32([[-1]]),
                        max_query_len=n, max_seq_len=n, is_decode=False, query_lens_cpu=[n], seq_lens_cpu=[n],
                        state_slots=i32([0]) if getattr(pool, "states", None) else None,
                        has_initial_state=torch.zeros(1, dtype=torch.bool, device=device))
    try:
        model(torch.tensor(ids, device=device), torch.arange(n, device=device), meta, rec)
    finally:
        for mod, tr in saved:
            mod.key_transform = tr
        if getattr(pool, "states", None):
            pool.reset_states([0])
    return {layer: key_statistics(k) for layer, k in rec.keys.items()}


def setup(model: torch.nn.Module, tokenizer, pool, device: torch.device, fmt, enabled: bool | None) -> str:
    """The engine's startup step: calibrate and install where ``enabled`` (None: for every quantized
    format, i.e. one with scales; unquantized KV gains nothing). Returns the startup line."""
    install(model, None)
    if not (fmt.has_scales if enabled is None else enabled) or not attention_layers(model):
        return "kv centring: off"
    if tokenizer is None:
        return "kv centring: off (the checkpoint has no tokenizer for the calibration passage)"
    ids = tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))[:TOKENS]
    install(model, calibrate(model, ids, pool, device))
    return (f"kv centring: on (keys (k - m) / s, queries q * s, per layer and kv head; m, s from {len(ids)} "
            f"tokens of {PASSAGE.name}, alpha={ALPHA:g})")
