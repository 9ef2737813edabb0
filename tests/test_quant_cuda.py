"""On a GPU: quantized linears run the Triton GEMMs (ninfer/kernels/{fp8,nvfp4}_gemm.py) and agree
with their own dequantize-then-matmul path; a quantized checkpoint generates the same greedy tokens
as its dequantized copy (bf16)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.models import load_model
from ninfer.quant import QuantLinear
from tests.test_quant_checkpoints import HYBRID, _greedy, ckpt, dense_copy  # noqa: F401 (fixture)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("quant", ["fp8", "fp8-ct", "nvfp4", "nvfp4-modelopt"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_kernels_match_dequantized_matmul(ckpt, quant: str, rows: int) -> None:
    model = load_model(ckpt(quant, 5, "dense"), dtype="bf16", device="cuda", progress=False)
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert mods and all(m.impl == "triton" for m in mods), [m.impl for m in mods]
    g = torch.Generator(device="cuda").manual_seed(rows)
    for m in mods:
        x = torch.randn(rows, m.in_features, device="cuda", generator=g, dtype=torch.bfloat16)
        got = m(x).float()
        ref = x.double() @ m.dequantized(torch.float64).t() if m.dense_weight is None else None
        if ref is None:
            continue
        err = (got - ref).abs().max().item()
        # bf16 activations; above 16 rows the FP8 GEMM also quantizes them (W8A8, 1/16 relative per value)
        tol = 0.06 if quant.startswith("fp8") and rows > 16 else 0.01
        assert err <= tol * ref.abs().max().item() + 1e-3, (m, err)


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_gpu_greedy_on_quantized_hybrid(ckpt, tmp_path: Path, quant: str) -> None:
    path = ckpt(quant, 6, "hybrid")
    prompts = [[5, 9, 33, 7, 100, 21], list(range(3, 40))]
    tokens, logits = _greedy(path, prompts, device="cuda")
    ref, ref_logits = _greedy(dense_copy(path, tmp_path / "dense"), prompts, device="cuda")
    for t, a, b in zip(tokens, logits, ref_logits):  # the prefill's logits: later steps may follow other tokens
        scale = b[0].abs().max()
        rel = ((a[0] - b[0]).abs().max() / scale).item()
        assert rel < 0.05, rel  # bf16 activations in the GEMMs (and W8A8 for the fp8 prefill)
        # the greedy pick is the reference's, or a near-tie of it within that logit error (a random model
        # can have two top logits closer than the quantization moves them)
        assert b[0][t[0]] >= b[0].max() - 2 * rel * scale, (t[0], int(b[0].argmax()))
