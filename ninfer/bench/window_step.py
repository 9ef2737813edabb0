"""`python -m ninfer.bench.window_step [--json F]` (CUDA): one layer's decode attention step (store,
split kernel, reduce; rk4v4-e8w also attends and writes its ring: inside the reduction on the Triton
path, on a second stream beside the split kernel on the CUDA path; the per-step plan, shared by all
layers, is left out), rk4v4-e8 vs rk4v4-e8w through KernelAttentionBackend with the CUDA and
the Triton split kernels, replayed as a CUDA graph (what the engine runs). Qwen3-8B geometry: 32 q /
8 kv heads, D 128. Prints the median per step and the ratio e8w / e8 (the v2 condition: <= 1.05); for the CUDA
path also the pages alone, the window kernel alone and its (block_w, num_warps) choices."""
import argparse
import json

import torch
import triton

from ninfer.attention.base import StepMetadata
from ninfer.attention.triton_backend import KernelAttentionBackend
from ninfer.kernels.window_attn import PARTIAL_CFG, WindowTail, window_partial
from ninfer.kvcache.formats import get_format
from ninfer.kvcache.pool import KVCachePool

HQ, HKV, D, PAGE = 32, 8, 128, 64
PARTIAL_CHOICES = ((32, 4), (64, 4), (128, 4), (32, 2))  # window_partial's (block_w, num_warps), CUDA path
DEFAULT_PARTIAL = dict(PARTIAL_CFG)


def step_time(fmt_name: str, batch: int, ctx: int, decode: str, pages_only: bool = False) -> float:
    """pages_only (rk4v4-e8w, CUDA split kernel): the step without the window's partial, so what the
    window adds is the difference."""
    dev = torch.device("cuda")
    pages = batch * (ctx // PAGE + 1)
    pool = KVCachePool(get_format(fmt_name), 1, HKV, D, pages, PAGE, dev, torch.bfloat16, num_slots=batch)
    g = torch.Generator(device=dev).manual_seed(0)
    for name, t in pool.layers[0].items():  # valid codes, small scales: realistic work, no NaN
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, device=dev, dtype=torch.uint8, generator=g))
        else:
            t.fill_(0.02)
    for ring in pool.windows:
        for t in ring.values():
            t.normal_(generator=g)
    be = KernelAttentionBackend(pool, dtype=torch.bfloat16, num_heads=HQ, force={"decode": decode})
    if pages_only:
        from ninfer.kernels.paged_decode import paged_decode_cuda
        fmt = get_format(fmt_name)

        def dec(q, planes, bt, lens, scale, splits, tail=None):
            return paged_decode_cuda(q, planes, planes, bt, lens, fmt, scale, num_splits=splits)
        be._decode = dec
    bt = torch.arange(pages, device=dev, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    slot = ((torch.arange(batch, device=dev) * bt.shape[1] + (ctx - 1) // PAGE) * PAGE + (ctx - 1) % PAGE)
    meta = StepMetadata(slot_mapping=slot.long(), query_start_loc=torch.arange(batch + 1, device=dev, dtype=torch.int32),
                        seq_lens=lens, block_tables=bt, max_query_len=1, max_seq_len=ctx, is_decode=True,
                        query_lens_cpu=[1] * batch, seq_lens_cpu=[ctx] * batch,
                        state_slots=torch.arange(batch, device=dev, dtype=torch.int32),
                        has_initial_state=torch.ones(batch, device=dev, dtype=torch.bool))
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(batch, HKV, D, device=dev, dtype=torch.bfloat16)

    be.plan(meta)  # once per step in the engine, shared by every layer: not part of a layer's time

    def run():
        return be.forward(0, q, k, v, meta, D ** -0.5)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1e3  # us


def partial_time(batch: int, ctx: int) -> float:
    """window_partial alone, graph-replayed (its current PARTIAL_CFG)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    ring = {n: torch.randn(batch, HKV, 128, D, device=dev, dtype=torch.bfloat16, generator=g) for n in "kv"}
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, HKV, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    ar = torch.arange(batch, device=dev, dtype=torch.int32)
    tail = WindowTail(q, k, v, ring, ar, torch.full_like(ar, ctx), torch.full_like(ar, 128), D ** -0.5)
    window_partial(tail)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window_partial(tail)
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for batch, ctx in ((1, 131072), (8, 32768)):
        for decode in ("cuda", "triton"):
            t = {f: step_time(f, batch, ctx, decode) for f in ("rk4v4-e8", "rk4v4-e8w")}
            r = {"batch": batch, "context": ctx, "decode": decode, "e8_us": t["rk4v4-e8"],
                 "e8w_us": t["rk4v4-e8w"], "ratio": t["rk4v4-e8w"] / t["rk4v4-e8"]}
            extra = ""
            if decode == "cuda":
                r["e8w_pages_only_us"] = step_time("rk4v4-e8w", batch, ctx, decode, pages_only=True)
                r["window_partial_us"] = partial_time(batch, ctx)
                for bw, nw in PARTIAL_CHOICES:
                    PARTIAL_CFG.update(block_w=bw, num_warps=nw)
                    t_s = step_time("rk4v4-e8w", batch, ctx, decode)
                    r[f"stream_w{bw}_nw{nw}_us"] = t_s
                    r[f"stream_w{bw}_nw{nw}_ratio"] = t_s / r["e8_us"]
                    extra += f"  stream w{bw}/nw{nw} {t_s / r['e8_us']:.3f}"
                PARTIAL_CFG.update(DEFAULT_PARTIAL)
                extra += f"  pages only {r['e8w_pages_only_us']:.1f} us  window_partial alone {r['window_partial_us']:.1f} us"
            rows.append(r)
            print(f"B={batch} ctx={ctx} decode={decode}: rk4v4-e8 {r['e8_us']:.1f} us  rk4v4-e8w {r['e8w_us']:.1f} us"
                  f"  ratio {r['ratio']:.3f} ({'ok' if r['ratio'] <= 1.05 else 'OVER 1.05'}){extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "geometry": {"hq": HQ, "hkv": HKV, "d": D},
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
