"""Does the rk4v4-e8 store (kv_store_rows) pay for a partly filled last wave? Graph-timed stores
(median of 3) at token counts that fill whole waves (8 kv heads, D128: 3168 tokens per wave at 6
blocks of 128 threads per SM on 132 SMs) and counts that do not. Run on a CUDA machine:

    PYTHONPATH=$PWD python3 scripts/store_wave_probe.py 12672 13000 15840 16384 19008
"""
import os
import sys

import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_store_prefill as b
from ninfer.kernels import store_kv_cuda as sc
gen = torch.Generator(device="cuda").manual_seed(0)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for tokens in [int(x) for x in sys.argv[1:]]:
    fmt, k, v, slots, newp = b.store_inputs("rk4v4-e8", 8, 128, tokens, gen, "pages")
    def store(kk, vv, planes, ss):
        sc.launch_store_kv_cuda(kk, vv, planes["k"].view(torch.int32), planes["k_scale"], planes["v"].view(torch.int32),
                                planes["v_scale"], ss, fmt.kernel_code, float(fmt.scale_divisor), b.PAGE)
    us = [b.graph_store_us(k, v, slots, newp(), store, gen) for _ in range(3)]
    us = sorted(us)[1]
    waves = tokens * 8 * 2 * 2 / (sms * 6 * 128)
    print(f"tokens={tokens} waves={waves:.2f} us={us:.2f} ns_per_token={1000 * us / tokens:.3f}", flush=True)
