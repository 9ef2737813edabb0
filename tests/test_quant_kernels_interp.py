"""QuantLinear with the Triton weight GEMMs (ninfer/kernels/fp8_gemm.py, nvfp4_gemm.py) serving,
under Triton's interpreter on CPU: the packed weights, merged-part layout and per-part global
scales reach the kernels as they expect, against float64 x @ dequantized(W)^T. Skipped where the
kernel modules are not part of the tree."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.triton_interp import case_result, child_main, module_results  # noqa: E402

HAVE_KERNELS = all(importlib.util.find_spec(f"ninfer.kernels.{m}") is not None for m in ("fp8_gemm", "nvfp4_gemm"))
pytestmark = pytest.mark.skipif(not HAVE_KERNELS, reason="the quantized GEMM kernels are not in this tree")
# quantized layout, linear, rows; FP8 above 16 rows also quantizes the activations (W8A8)
CASES = [(f"{q}-{lin}-{m}", q, lin, m) for q in ("fp8", "fp8-ct", "nvfp4", "nvfp4-modelopt")
         for lin in ("qkv_proj", "down_proj") for m in (1, 40)]
GEOM = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128, vocab_size=512)


def run_case(name: str, quant: str, lin: str, rows: int) -> dict:
    import tempfile

    import torch

    from ninfer.models import load_model
    from ninfer.quant.linear import gpu_kernel
    from ninfer.tools.random_checkpoint import write_random_checkpoint
    with tempfile.TemporaryDirectory() as d:
        model = load_model(write_random_checkpoint(d, GEOM, device="cpu", seed=3, quant=quant, tokenizer=None),
                           dtype="bf16", progress=False)
    layer = model.model.layers[0]
    mod = layer.self_attn.qkv_proj if lin == "qkv_proj" else layer.mlp.down_proj
    mod.kernel, mod.impl = gpu_kernel(mod.qc.method), "triton"  # finalize() picks them on CUDA only
    x = torch.randn(rows, mod.in_features, generator=torch.Generator().manual_seed(rows), dtype=torch.bfloat16)
    ref = x.double() @ mod.dequantized(torch.float64).t()
    got = mod(x).double()
    return {"name": name, "rel": ((got - ref).abs().max() / ref.abs().max()).item(), "shape": list(got.shape),
            "out": mod.out_features}


results = module_results(__file__)


@pytest.mark.parametrize("name,quant,lin,rows", CASES)
def test_kernels_through_quant_linear(results: dict, name: str, quant: str, lin: str, rows: int) -> None:
    r = case_result(results, name)
    assert r["shape"] == [rows, r["out"]]
    # bf16 activations (measured 0.3-0.6%); W8A8 rounds each activation to e4m3 (measured 2.8% at 80 rows)
    assert r["rel"] < (0.06 if quant.startswith("fp8") and rows > 16 else 0.015), r


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(child_main(CASES, run_case))
