"""A linear whose checkpoint weights are FP8-block or NVFP4 quantized, kept packed in memory.

It stands in for an nn.Linear or a MergedLinear (q|k|v, gate|up, the GDN in-projection): the
quantized parts fill consecutive row blocks of one packed weight and its scales, parts the checkpoint
left unquantized (e.g. a GDN layer's small in_proj_a/b) fill a dense weight, and the output is the
two in the original row order. CPU: dequantize to the activation dtype, then matmul (the reference).
CUDA: the Triton GEMMs of ninfer/kernels/{fp8,nvfp4}_gemm.py when importable, else the same
dequantize-then-matmul."""
from __future__ import annotations

import functools
import importlib
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.quant import codec
from ninfer.quant.config import FP8_BLOCK, NVFP4_GROUP, QuantConfig, QuantConfigError

log = logging.getLogger(__name__)
_KERNELS = {"fp8": ("ninfer.kernels.fp8_gemm", "fp8_block_linear"),
            "nvfp4": ("ninfer.kernels.nvfp4_gemm", "nvfp4_linear")}


@functools.lru_cache(maxsize=None)  # decided once per process, warned about once
def gpu_kernel(method: str):
    """The Triton GEMM for `method`, or None when its module is not there (dequantize-then-matmul)."""
    mod, fn = _KERNELS[method]
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        log.warning("%s.%s unavailable (%s): %s linears dequantize then matmul on CUDA", mod, fn, e, method)
        return None


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantLinear(nn.Module):
    """`parts` = ((checkpoint name, rows, quantized), ...) in row order; a name "" is the module
    itself (a plain linear), else the sibling checkpoint module it replaces (merged)."""

    def __init__(self, qc: QuantConfig, in_features: int, parts: tuple[tuple[str, int, bool], ...], bias: bool,
                 dtype: torch.dtype, where: str = "") -> None:
        super().__init__()
        self.qc, self.parts, self.in_features = qc, parts, in_features
        self.out_features = sum(r for _, r, _ in parts)
        self.wname, self.sname, self.gname = qc.tensor_names()
        nq = sum(r for _, r, q in parts if q)
        nd = self.out_features - nq
        k = in_features
        if qc.method == "fp8":
            merged = [(n, r) for n, r, q in parts if q]
            bad = [(n, r) for n, r in merged if r % FP8_BLOCK] if len(merged) > 1 else []
            if bad:
                raise QuantConfigError(
                    f"{where}: FP8 block scales cannot be merged: {bad[0][0]} has {bad[0][1]} rows, not a multiple "
                    f"of the {FP8_BLOCK}-row block (parts {', '.join(f'{n}={r}' for n, r in merged)})")
            self.register_parameter(self.wname, _param((nq, k), torch.float8_e4m3fn))
            self.register_parameter(self.sname, _param((math.ceil(nq / FP8_BLOCK), math.ceil(k / FP8_BLOCK)),
                                                       torch.float32))
        else:
            if k % NVFP4_GROUP:
                raise QuantConfigError(f"{where}: NVFP4 needs in_features divisible by {NVFP4_GROUP}, got {k}")
            self.register_parameter(self.wname, _param((nq, k // 2), torch.uint8))
            self.register_parameter(self.sname, _param((nq, k // NVFP4_GROUP), torch.float8_e4m3fn))
            gshape = () if qc.layout == "modelopt" else (1,)
            for i in range(sum(q for _, _, q in parts)):
                self.register_parameter(f"{self.gname}_{i}", _param(gshape, torch.float32))
        self.dense_weight = _param((nd, k), dtype) if nd else None
        self.bias = _param((self.out_features,), dtype) if bias else None
        # output row j is row perm[j] of [quantized rows, dense rows]; None when already in order
        order, qs, ds = [], 0, nq
        for _, r, q in parts:
            start = qs if q else ds
            order += range(start, start + r)
            qs, ds = (qs + r, ds) if q else (qs, ds + r)
        self._order = None if order == list(range(self.out_features)) else order
        self.perm: torch.Tensor | None = None
        self.impl = "dequant"
        self.kernel = None
        self.globals: list[tuple[int, int, torch.Tensor]] = []  # (first row, rows, divisor) per quantized part
        self.uniform = True

    def checkpoint_entries(self, mod_name: str) -> dict[str, tuple[str, int | None, int | None]]:
        """checkpoint tensor -> (parameter, first row, rows), as CausalLM.checkpoint_map."""
        parent = mod_name.rsplit(".", 1)[0]
        out: dict[str, tuple[str, int | None, int | None]] = {}
        row = qrow = drow = qi = 0
        single = len(self.parts) == 1
        for name, rows, quant in self.parts:
            ck = f"{parent}.{name}" if name else mod_name
            if quant:
                out[f"{ck}.{self.wname}"] = (f"{mod_name}.{self.wname}",) + ((None, None) if single else (qrow, rows))
                if self.qc.method == "fp8":
                    out[f"{ck}.{self.sname}"] = ((f"{mod_name}.{self.sname}", None, None) if single else
                                                 (f"{mod_name}.{self.sname}", qrow // FP8_BLOCK, math.ceil(rows / FP8_BLOCK)))
                else:
                    out[f"{ck}.{self.sname}"] = (f"{mod_name}.{self.sname}",) + ((None, None) if single else (qrow, rows))
                    out[f"{ck}.{self.gname}"] = (f"{mod_name}.{self.gname}_{qi}", None, None)
                qrow, qi = qrow + rows, qi + 1
            else:
                out[f"{ck}.weight"] = (f"{mod_name}.dense_weight", drow, rows)
                drow += rows
            if self.bias is not None:
                out[f"{ck}.bias"] = (f"{mod_name}.bias",) + ((None, None) if single else (row, rows))
            row += rows
        return out

    def finalize(self) -> None:
        """After loading: the per-part global scales as divisors, and the kernel choice for the device."""
        dev = getattr(self, self.wname).device
        self.globals = []
        qrow = 0
        if self.qc.method == "nvfp4":
            i = 0
            for _, rows, quant in self.parts:
                if quant:
                    g = getattr(self, f"{self.gname}_{i}").detach().float().reshape(())
                    self.globals.append((qrow, rows, 1.0 / g if self.qc.layout == "modelopt" else g))
                    qrow, i = qrow + rows, i + 1
            self.uniform = len({float(g) for _, _, g in self.globals}) == 1
        self.perm = None if self._order is None else torch.tensor(self._order, device=dev)
        self.kernel = gpu_kernel(self.qc.method) if dev.type == "cuda" else None
        self.impl = "triton" if self.kernel is not None else "dequant"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The quantized rows as a dense [rows, in_features] weight (the CPU path and the test oracle)."""
        w, s = getattr(self, self.wname), getattr(self, self.sname)
        if self.qc.method == "fp8":
            return codec.fp8_block_dequant(w, s, dtype)
        return torch.cat([codec.nvfp4_dequant(w[a:a + n], s[a:a + n], g, dtype) for a, n, g in self.globals])

    def _quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.qc.method == "nvfp4" and not self.globals:
            raise RuntimeError("QuantLinear.finalize() must run after the weights are loaded")
        if self.impl != "triton" or x.dtype == torch.float32:  # the GEMMs take bf16 / fp16 activations
            return F.linear(x, self.dequantized(x.dtype))
        w, s = getattr(self, self.wname), getattr(self, self.sname)
        if self.qc.method == "fp8":
            return self.kernel(x, w, s, None)
        if self.uniform:
            return self.kernel(x, w, s, self.globals[0][2], None)
        return torch.cat([self.kernel(x, w[a:a + n], s[a:a + n], g, None) for a, n, g in self.globals], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        y = self._quantized_matmul(x)
        if self.dense_weight is not None:
            y = torch.cat((y, F.linear(x, self.dense_weight)), dim=-1)
        if self.perm is not None:
            y = y.index_select(-1, self.perm)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        q = sum(r for _, r, q in self.parts if q)
        return f"{self.qc.name}, in={self.in_features}, out={self.out_features} (quantized rows {q}), impl={self.impl}"
