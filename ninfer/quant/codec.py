"""The weight codecs in torch: FP8 128x128 block scales and NVFP4 (e2m1 pairs in a byte, one fp8
scale per 16 columns, a global scale per tensor). Dequantization is the CPU path and the oracle of
the GPU kernels; quantization writes checkpoints (ninfer/tools/random_checkpoint.py)."""
from __future__ import annotations

import torch

from ninfer.quant.config import FP8_BLOCK, NVFP4_GROUP

FP8_MAX = 448.0  # float8_e4m3fn
# e2m1 code -> value: bit 3 is the sign, bits 0-2 index the magnitudes
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _expand(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def fp8_block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w[N, K] = weight * scale_inv of its 128x128 block (computed in fp32)."""
    n, k = weight.shape
    return (weight.float() * _expand(scale_inv.float(), n, k, FP8_BLOCK, FP8_BLOCK)).to(dtype)


def fp8_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [N, K], weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]): each block's
    scale is its absmax / 448 (1 for an all-zero block), the weight rounded to nearest fp8."""
    n, k = w.shape
    b = FP8_BLOCK
    pad = torch.nn.functional.pad(w.float(), (0, -k % b, 0, -n % b))
    amax = pad.abs().reshape(pad.shape[0] // b, b, pad.shape[1] // b, b).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / _expand(scale, n, k, b, b)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> fp32 [N, K]; the low nibble is the even column."""
    table = E2M1.to(packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return table[codes.long()]


def nvfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | float,
                  dtype: torch.dtype) -> torch.Tensor:
    """w[N, K] = e2m1 * (weight_scale / global_scale) per 16 columns, in fp32 (compressed-tensors'
    convention; ModelOpt's global is 1 / weight_scale_2)."""
    n = packed.shape[0]
    s = scale.float() / global_scale
    return (unpack_e2m1(packed) * _expand(s, n, 2 * packed.shape[1], 1, NVFP4_GROUP)).to(dtype)


def nvfp4_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_global_scale fp32 [1])
    made by compressed-tensors' own NVFP4 scale rules and compressor."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    n, k = w.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs in_features divisible by {NVFP4_GROUP}, got {k}")
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    wf = w.float()
    g = generate_gparam(wf.min(), wf.max())
    groups = wf.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
    out = NVFP4PackedCompressor.compress({"weight": wf, "weight_scale": scale, "weight_global_scale": g}, scheme)
    return out["weight_packed"], out["weight_scale"], out["weight_global_scale"].float().reshape(1)
