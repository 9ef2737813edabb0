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
        d = {**sc.defs(code, k.dtype, slots.dtype), "KV_ROWS_MINB": minb, **({"KV_RINT_ADD": 1} if ra else {})}
        _m, fn, _s, occ, regs = sc._STORE.load(d, k.device, 0, 128, "kv_store_rows")
        pl = newp()

        def run():
            kd, vd = pl["k"].view(torch.int32), pl["v"].view(torch.int32)
            sc._STORE.launch(fn, ((16384 * 2 * 2 + 127) // 128, 8, 1), 128, 0, torch.cuda.current_stream().cuda_stream,
                [k, v, ("i64", k.stride(0)), ("i64", k.stride(1)), ("i64", v.stride(0)), ("i64", v.stride(1)),
                 kd, pl["k_scale"], vd, pl["v_scale"], slots, 16384, 8, 1, 6, 0.125])
        run()
        torch.cuda.synchronize()
        got = torch.cat([p.view(torch.uint8).flatten() for p in pl.values()])
        us = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median") * 1e3
        print(f"{name} minb={minb}{' rint_add' if ra else ''} regs={regs} occ={occ} us={us:.1f} bad_vs_triton={(got != refb).float().mean().item():.1e}", flush=True)
