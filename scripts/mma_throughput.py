"""Issue cost of the tensor-pipe and integer-pipe instructions the decode kernel is made of, on a GPU.

    PYTHONPATH=$PWD python3 scripts/mma_throughput.py --out $OUT/mma_throughput.json

One block per SM, 8 or 16 warps; every thread runs a loop of 8 independent accumulator chains per
instruction kind (mma.sync m16n8k16 f16 -> f32 and -> f16, m16n8k32 u8 x s8, m16n8k256 b1 and.popc,
and the lop3 / prmt / i2f / sub.f16x2 / imad of the operand conversions), clock64 around it. Printed:
cycles per iteration per SM sub-partition (2 or 4 warps each); an iteration is 8 MMAs, or 16 of the
integer / conversion ops (8 for sub.f16x2). With 8 warps the MMAs are latency-bound, with 16 closer
to the pipe's rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.kernels import cuda_build  # noqa: E402

SRC = r"""
#include "decode_ops.cuh"
using namespace nd;
template <int OP>
__device__ __forceinline__ void step(uint32_t (&r)[8][4], const uint32_t (&aj)[8], uint32_t a, uint32_t b) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (OP == 0) mma16816(reinterpret_cast<float*>(r[j]), a, b, aj[j], b, a, b);
    if (OP == 1) imma16832(reinterpret_cast<int*>(r[j]), a, b, aj[j], b, a, b);
    if (OP == 2) bmma_popc(reinterpret_cast<int*>(r[j]), a, b, aj[j], b, a, b);
    if (OP == 3)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};"
                   : "+r"(r[j][0]), "+r"(r[j][1]) : "r"(a), "r"(b), "r"(aj[j]), "r"(b), "r"(a), "r"(b));
    if (OP == 4) { r[j][0] = lop_and_or(r[j][0], a, b); r[j][1] = lop_and_or(r[j][1], b, a); }
    if (OP == 5) { r[j][0] = prmt(r[j][0], a, 0x5140); r[j][1] = prmt(r[j][1], b, 0x6240); }
    if (OP == 6) { r[j][0] = __float_as_uint((float)(int)r[j][0]); r[j][1] = __float_as_uint((float)(int)r[j][1]); }
    if (OP == 7) { r[j][0] = hsub2u(r[j][0], a); r[j][1] = hsub2u(r[j][1], b); }
    if (OP == 8) { r[j][0] = r[j][0] * a + b; r[j][1] = r[j][1] * b + a; }
  }
}
template <int OP>
__device__ void body(uint32_t* out, long long* cyc, int iters, uint32_t a, uint32_t b) {
  uint32_t r[8][4], aj[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    r[j][0] = r[j][1] = r[j][2] = r[j][3] = threadIdx.x + j;
    aj[j] = a ^ (j * 0x01010101u);
  }
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 1
  for (int i = 0; i < iters; ++i) step<OP>(r, aj, a, b);
  __syncthreads();
  const long long t1 = clock64();
  uint32_t x = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) x ^= r[j][0] ^ r[j][1] ^ r[j][2] ^ r[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = x;  // keeps every chain live
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}
#define K(n) extern "C" __global__ void __launch_bounds__(512) k##n(uint32_t* o, long long* c, int it, uint32_t a, \
                                                                     uint32_t b) { body<n>(o, c, it, a, b); }
K(0) K(1) K(2) K(3) K(4) K(5) K(6) K(7) K(8)
"""
NAMES = ["hmma16816.f32", "imma16832.u8s8", "bmma168256.popc", "hmma16816.f16", "lop3", "prmt", "i2f", "sub.f16x2",
         "imad"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("decode_ops.cuh", "rtc_compat.cuh"):
            (Path(tmp) / name).write_text((cuda_build.CSRC / name).read_text())
        (Path(tmp) / "mma_throughput.cu").write_text(SRC)
        prog = cuda_build.CudaProgram("mma_throughput.cu", ("rtc_compat.cuh", "decode_ops.cuh"), "k0", Path(tmp))
        for op, name in enumerate(NAMES):
            for warps in (8, 16):
                _mod, fn, _smem, _occ, _regs = prog.load({}, dev, 0, warps * 32, entry=f"k{op}")
                out = torch.empty(sms * warps * 32, dtype=torch.int32, device=dev)
                cyc = torch.empty(sms, dtype=torch.int64, device=dev)
                for _ in range(3):  # the last launch counts; the first ones load the module and warm up
                    prog.launch(fn, (sms, 1, 1), warps * 32, 0, torch.cuda.current_stream().cuda_stream,
                                [out, cyc, a.iters, 12345, 678])
                torch.cuda.synchronize()
                per = cyc.double().median().item() / (warps / 4 * a.iters)
                res[f"{name}/w{warps}"] = per
                print(f"{name:16s} {warps:2d} warps/SM: {per:6.2f} cycles per iteration per sub-partition", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "iters": a.iters,
                                           "cycles_per_iteration_per_smsp": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
