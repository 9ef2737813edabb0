"""The CUDA store's thread-per-group kernel (kv_store_rows) at several register caps
(KV_ROWS_MINB = blocks per SM the registers must allow), side by side on one GPU: 16384 bf16
tokens, 8 KV heads, D128, whole pages; each variant's bytes compared with the Triton store's,
then timed (median of do_bench). Run from the repository root on a CUDA machine:

    PYTHONPATH=$PWD python3 scripts/store_rows_regcap.py [--rint-add 0,1]

--rint-add adds the KV_RINT_ADD variants (kv_encode.cuh: rint and the nibble by float adds
instead of FRND / F2I); the default, 0, is the run logged in docs/results/store_rows_regcap_20261130.log.
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_store_prefill as b
from ninfer.kernels import store_kv_cuda as sc
from ninfer.kernels._common import FMT_E8, FMT_RK4
from ninfer.kernels.store_kv import store_kv
rint_adds = [int(x) for x in sys.argv[sys.argv.index("--rint-add") + 1].split(",")] if "--rint-add" in sys.argv else [0]
gen = torch.Generator(device="cuda").manual_seed(0)
for name, code in (("rk4v4-e8", FMT_E8), ("rk4v4", FMT_RK4)):
    fmt, k, v, slots, newp = b.store_inputs(name, 8, 128, 16384, gen, "pages")
    ref = newp()
    store_kv(k, v, ref, slots, name, backend="triton")
    refb = torch.cat([p.view(torch.uint8).flatten() for p in ref.values()])
    for minb, ra in [(m, r) for r in rint_adds for m in (1, 4, 6, 8)]:
        variant = {"KV_ROWS_MINB": minb, **({"KV_RINT_ADD": 1} if ra else {})}
        _m, _fn, _s, occ, regs = sc._STORE.load({**sc.defs(code, k.dtype, slots.dtype), **variant}, k.device, 0,
                                                sc.THREADS, "kv_store_rows")
        pl = newp()

        def run():
            sc.store_kv_cuda(k, v, pl["k"].view(torch.int32), pl["k_scale"], pl["v"].view(torch.int32),
                             pl["v_scale"], slots, code, float(fmt.scale_divisor), b.PAGE, variant)
        run()
        torch.cuda.synchronize()
        got = torch.cat([p.view(torch.uint8).flatten() for p in pl.values()])
        us = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median") * 1e3
        print(f"{name} minb={minb}{' rint_add' if ra else ''} regs={regs} occ={occ} us={us:.1f} bad_vs_triton={(got != refb).float().mean().item():.1e}", flush=True)
