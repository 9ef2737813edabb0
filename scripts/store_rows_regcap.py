"""The CUDA store's thread-per-group kernel (kv_store_rows) at several register caps
(KV_ROWS_MINB = blocks per SM the registers must allow), side by side on one GPU: 16384 bf16
tokens, 8 KV heads, D128, whole pages; each variant's bytes compared with the Triton store's,
then timed as CUDA-graph replays over distinct inputs (bench_store_prefill.graph_store_us). Run
from the repository root on a CUDA machine:

    PYTHONPATH=$PWD python3 scripts/store_rows_regcap.py [MINB ...]   (default 1 4 6 8)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_store_prefill as b
from ninfer.kernels import store_kv_cuda as sc
from ninfer.kernels.store_kv import store_kv_triton
gen = torch.Generator(device="cuda").manual_seed(0)
for name in ("rk4v4-e8", "rk4v4"):
    fmt, k, v, slots, newp = b.store_inputs(name, 8, 128, 16384, gen, "pages")
    code = fmt.kernel_code
    ref = newp()
    store_kv_triton(k, v, ref, slots, fmt)
    refb = torch.cat([p.view(torch.uint8).flatten() for p in ref.values()])
    for minb in [int(x) for x in sys.argv[1:]] or (1, 4, 6, 8):
        variant = {"KV_ROWS_MINB": minb}
        _m, _fn, _s, occ, regs = sc._STORE.load({**sc.defs(code, k.dtype, slots.dtype), **variant}, k.device, 0,
                                                sc.THREADS, "kv_store_rows")
        pl = newp()

        def store(kk, vv, planes, ss):
            sc.launch_store_kv_cuda(kk, vv, planes["k"].view(torch.int32), planes["k_scale"],
                                    planes["v"].view(torch.int32), planes["v_scale"], ss, code,
                                    float(fmt.scale_divisor), b.PAGE, variant)
        store(k, v, pl, slots)
        torch.cuda.synchronize()
        got = torch.cat([p.view(torch.uint8).flatten() for p in pl.values()])
        us = b.graph_store_us(k, v, slots, pl, store, gen)
        print(f"{name} minb={minb} regs={regs} occ={occ} us={us:.1f} bad_vs_triton={(got != refb).float().mean().item():.1e}", flush=True)
