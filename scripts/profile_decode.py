"""Where a decode step's time goes, on a GPU: per kv-dtype, one engine, one long prompt, then
decode steps timed three ways and the step's kernels listed.

    python3 scripts/profile_decode.py MODEL_DIR --kv-dtype int8,rk4v4-e8 --prompt-tokens 90000 --out prof.json

* step: wall time of ``LLMEngine.step()`` in steady decode (what ``bench matched`` sees);
* replay: GPU time of the captured decode graph alone, back to back (CUDA events);
* kernels: torch.profiler over a few eager forwards with the same inputs: kernel count per step,
  GPU time per kernel name, attention kernels separated.
step - replay - logits/sampling is time the GPU waits for the host.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def profile_kv(model: str, kv: str, prompt_tokens: int, steps: int, top: int) -> dict:
    from ninfer.bench import _timing as T
    from ninfer.config import EngineConfig
    from ninfer.engine.sampling import SamplingParams
    cfg = EngineConfig(model=model, kv_dtype=kv, max_context=prompt_tokens + steps + 64,
                       enable_prefix_caching=False, max_num_seqs=8)
    engine = T.start_engine(cfg)
    try:
        vocab = engine.model_config.vocab_size
        prompt = T.random_prompt(vocab, prompt_tokens, body_seed=1, head_seed=0)
        engine.add_request("p", prompt, SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True))
        while True:  # prefill
            outs = engine.step()
            if any(o.new_token_ids for o in outs):
                break
        for _ in range(8):  # warm decode
            engine.step()
        torch.cuda.synchronize()
        wall = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            wall.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        graphs = getattr(engine.runner, "decode_graphs", None)
        res = {"kv_dtype": kv, "prompt_tokens": prompt_tokens, "step_ms": statistics.median(wall),
               "step_ms_p10": sorted(wall)[len(wall) // 10], "cuda_graphs": graphs is not None}
        if graphs is not None:
            g = graphs.graphs[graphs.sizes[0]]
            g.replay()
            res["replay_ms"] = _median_ms(g.replay, 30)
            with torch.inference_mode():
                def run_eager():
                    return graphs._run(1)
                h = run_eager()
                res["eager_forward_ms"] = _median_ms(run_eager, 10)
                model = engine.model
                res["logits_ms"] = _median_ms(lambda: model.compute_logits(h[:1]), 30)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        run_eager()
                    torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as gprof:
                    for _ in range(3):
                        g.replay()
                    torch.cuda.synchronize()
            res["graph_kernels"] = _kernel_table(gprof, 3, top)
            res.update(_kernel_table(prof, 3, top))
        return res
    finally:
        del engine
        T.release()


def _kernel_table(prof, n_steps: int, top: int) -> dict:
    rows = []
    n_kernels = 0
    total_us = 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = e.cuda_time_total
        if dev_us <= 0 or e.key.startswith("cuda") or "Memcpy" in e.key or "Memset" in e.key:
            continue
        rows.append({"name": e.key[:120], "calls_per_step": e.count / n_steps, "us_per_step": dev_us / n_steps})
        n_kernels += e.count / n_steps
        total_us += dev_us / n_steps
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"kernels_per_step": n_kernels, "kernel_us_per_step": total_us, "top_kernels": rows[:top]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--kv-dtype", default="int8,rk4v4-e8")
    p.add_argument("--prompt-tokens", type=int, default=90000)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    p_one = a.one
    if p_one:
        print("RESULT " + json.dumps(profile_kv(a.model, p_one, a.prompt_tokens, a.steps, a.top)))
        return 0
    results = []
    for kv in a.kv_dtype.split(","):
        cmd = [sys.executable, __file__, a.model, "--one", kv, "--prompt-tokens", str(a.prompt_tokens),
               "--steps", str(a.steps), "--top", str(a.top)]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
        results.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv,
                       "results": results}, f, indent=1)
    for r in results:
        print(f"\n== {r['kv_dtype']}: step {r['step_ms']:.3f} ms (p10 {r['step_ms_p10']:.3f})  "
              f"replay {r.get('replay_ms', float('nan')):.3f}  eager {r.get('eager_forward_ms', float('nan')):.3f}  "
              f"logits {r.get('logits_ms', float('nan')):.3f}  kernels/step {r.get('kernels_per_step', 0):.0f}  "
              f"kernel time {r.get('kernel_us_per_step', 0) / 1e3:.3f} ms")
        for k in r.get("top_kernels", []):
            print(f"   {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['name'][:90]}")
        gk = r.get("graph_kernels")
        if gk:
            print(f"  in the graph: {gk['kernels_per_step']:.0f} kernels, {gk['kernel_us_per_step'] / 1e3:.3f} ms")
            for k in gk["top_kernels"][:8]:
                print(f"   {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
