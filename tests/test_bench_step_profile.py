"""`python -m ninfer.bench.step_profile`: kernel names as the H200's profiler reports them land in
the kind the docs' table sums them under; without a GPU the bench refuses in one line."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ninfer.bench.step_profile import kind_of

SEEN = {  # names from the H200 runs behind docs/BENCHMARKS.md "Quantized weights"
    "nd_decode": "attention", "_decode_reduce_kernel": "attention", "_window_partial_kernel": "attention",
    "_fp8_gemv_kernel": "linear", "_nvfp4_gemv_kernel": "linear", "nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT": "linear",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "linear",
    "kv_store": "kv store", "_rmsnorm_kernel": "norm + rope", "_qk_norm_rope_kernel": "norm + rope",
    "_silu_mul_kernel": "activation",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>": "sampling",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "elementwise / copy",
}


@pytest.mark.parametrize("name", sorted(SEEN))
def test_kernel_kinds(name: str) -> None:
    assert kind_of(name) == SEEN[name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_cuda(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "ninfer.bench.step_profile", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
