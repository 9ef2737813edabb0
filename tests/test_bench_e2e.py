"""The engine benchmarks on CPU with tiny checkpoints: `ninfer bench matched|sweep|memory` end to end,
the cache-artifact (TTFT collapse) detector, and the random-weight checkpoint writer."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ninfer import cli
from ninfer.bench import _timing, matched
from ninfer.config import PAGE_SIZE

# small enough for the 2-core CI machine: one chunk of 128 tokens, one sequence at a time
ENGINE = ["--device", "cpu", "--max-num-batched-tokens", "128", "--max-concurrency", "1"]


def _bench(*argv: str) -> int:
    return cli.main(["bench", *argv])


def test_ttft_collapse_detector() -> None:
    assert _timing.ttft_collapse([10.0, 9.5, 10.4]) == []
    assert _timing.ttft_collapse([10.0, 4.9, 9.0, 0.2]) == [1, 3]
    assert _timing.ttft_collapse([10.0, 5.0]) == []            # exactly half is not a collapse
    assert _timing.ttft_collapse([10.0, 1.0], factor=0) == []   # off
    assert _timing.ttft_collapse([3.0]) == []
    rep = {"ttft_s": 1.0, "cached_tokens": 0}
    errs = matched.check({"repeats": [rep, {**rep, "ttft_s": 0.2}, {**rep, "cached_tokens": 64}]}, 0.5)
    assert len(errs) == 2 and "cache served" in errs[0] and "64 prompt tokens" in errs[1]


def test_random_prompt_head_varies() -> None:
    a = _timing.random_prompt(1000, 300, body_seed=1, head_seed=0)
    b = _timing.random_prompt(1000, 300, body_seed=1, head_seed=1)
    assert len(a) == 300 and a[PAGE_SIZE:] == b[PAGE_SIZE:] and a[:PAGE_SIZE] != b[:PAGE_SIZE]
    assert max(a) < 1000 and min(a) >= 0


def test_matched_two_kv_dtypes(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "matched.json"
    rc = _bench("matched", str(tiny_model_dir), *ENGINE, "--kv-dtype", "int8,rk4v4-e8", "--prompt-tokens", "200",
                "--gen-tokens", "4", "--repeats", "2", "--warmup-tokens", "64", "--collapse-factor", "0",
                "--json", str(out))
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["bench"] == "matched" and d["ok"] and d["ratio_reference"] == "int8"
    assert set(d["results"]) == {"int8", "rk4v4-e8"}
    for kv, r in d["results"].items():
        assert len(r["repeats"]) == 2
        for rep in r["repeats"]:
            assert rep["prompt_tokens"] == 200 and rep["generated_tokens"] == 4 and rep["cached_tokens"] == 0
        for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
            assert math.isfinite(r["median"][key]) and r["median"][key] > 0
        assert set(r["ratio_vs_ref"]) == {"prefill_tok_s", "decode_tok_s"}
        assert any(f"kv_dtype={kv}" in line for line in r["engine"]["startup_lines"])
        assert "prefix_reuse=0" in r["engine"]["startup_lines"][-1]
    assert d["results"]["int8"]["ratio_vs_ref"]["prefill_tok_s"] == 1.0
    assert d["settings"]["prompt_tokens"] == 200 and d["settings"]["prefix_reuse"] is False
    # interleaved rounds: A B, then B A
    assert d["settings"]["order"] == ["0:int8", "0:rk4v4-e8", "1:rk4v4-e8", "1:int8"]
    assert [x["round"] for x in d["results"]["int8"]["repeats"]] == [0, 1]


def test_matched_schedule_balances_order() -> None:
    assert matched.schedule(["a", "b"], 4) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"),
                                               (2, "a"), (2, "b"), (3, "b"), (3, "a")]
    visits = matched.schedule(["a", "b", "c"], 2)
    assert [kv for _, kv in visits] == ["a", "b", "c", "c", "b", "a"]


def test_sweep_explicit_contexts(tiny_model_dir: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    # 0.01 GiB holds tens of thousands of tiny-model tokens but not 2M
    rc = _bench("sweep", str(tiny_model_dir), *ENGINE, "--kv-dtype", "int8,rk4v4-e8", "--contexts", "192,320,2M",
                "--gen-tokens", "4", "--memory-limit", "0.01", "--plot", str(png), "--json", str(out))
    assert rc == 0
    d = json.loads(out.read_text())
    for kv in ("int8", "rk4v4-e8"):
        res = d["results"][kv]
        rows = {r["context"]: r for r in res["rows"]}
        assert set(rows) == {192, 320, 2 * 2**20}
        assert "does not fit" in rows[2 * 2**20]["skipped"]
        for c in (192, 320):
            assert rows[c]["prompt_tokens"] == c - 4 and math.isfinite(rows[c]["prefill_tok_s"])
            assert rows[c]["decode_tok_s"] > 0 and rows[c]["wall_s"] >= rows[c]["ttft_s"]
        assert res["engine"]["max_context"] == 320 and 320 < res["planner_largest_context"] < 2 * 2**20
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_sweep_auto_contexts() -> None:
    from ninfer.bench.sweep import contexts_for

    class A:
        contexts, auto_start, auto_cap = "auto", 32768, None
    assert contexts_for(A, 300_000) == [32768, 65536, 131072, 262144, 300_000 - 300_000 % 64]
    A.auto_cap = 100_000
    assert contexts_for(A, 300_000) == [32768, 65536, 100_000 - 100_000 % 64]
    assert contexts_for(A, 1000) == []


def test_memory_agreement_and_frontier(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    rc = _bench("memory", str(tiny_model_dir), *ENGINE, "--kv-dtype", "int8,rk4v4-e8", "--memory-limit", "0.01",
                "--max-context", "1024", "--gen-tokens", "3", "--frontier", "--starts", "2", "--json", str(out))
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["ok"]
    largest = {}
    for kv, res in d["results"].items():
        a = res["agreement"]
        assert a["terms"]["kv"]["pct"] == 0 and a["terms"]["weights"]["pct"] == 0
        assert all(v["bytes"] is None for v in a["device"].values())  # CPU: no device peak
        f = res["frontier"]
        assert f["largest_ok"] > 1024 and f["largest_ok"] % PAGE_SIZE == 0
        assert f["smallest_refused"] == f["largest_ok"] + PAGE_SIZE
        assert f["largest_ok"] == f["planner_largest_context"] == f["first_search_largest_ok"]  # CPU: no drift
        assert "does not fit" in f["refusal"] and f["starts_ok"] == 2 and not f["failures"]
        largest[kv] = f["largest_ok"]
    assert largest["rk4v4-e8"] > largest["int8"]  # fewer bytes per token, more context


def test_memory_frontier_refuses_when_nothing_fits(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "none.json"
    rc = _bench("memory", str(tiny_model_dir), *ENGINE, "--kv-dtype", "int8", "--memory-limit", "0.0001",
                "--no-agreement", "--frontier", "--starts", "1", "--json", str(out))
    assert rc == 1
    f = json.loads(out.read_text())["results"]["int8"]["frontier"]
    assert f["largest_ok"] == 0 and f["starts"] == [] and "no context fits at all" in f["failures"]


def test_random_checkpoint_loads_and_matches_transformers(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from ninfer.models.loader import load_model, load_tokenizer
    from ninfer.tools.random_checkpoint import main, tensor_specs, geometry
    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.kvcache.pool import KVCachePool
    from tests.tiny_models import build_metadata

    geo = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=320)
    sets = [a for k, v in geo.items() for a in ("--set", f"{k}={v}")]
    out = tmp_path / "rand"
    assert main(["--preset", "qwen3-8b", "--out", str(out), "--device", "cpu", "--tokenizer-from", "byte",
                 "--shard-gib", str(20_000 / 2**30), *sets]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert set(index["weight_map"]) == {n for n, _, _ in tensor_specs(geometry("qwen3-8b", **geo))}
    shard = out / index["weight_map"]["model.embed_tokens.weight"]
    with safe_open(str(shard), framework="pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.dtype == torch.bfloat16 and abs(emb.float().std().item() - 0.02) < 0.002
    assert len(load_tokenizer(out)) <= geo["vocab_size"]

    model = load_model(out, "fp32", "cpu", progress=False)
    cfg = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 64)
    ids = torch.randint(geo["vocab_size"], (40,), generator=torch.Generator().manual_seed(0))
    pool = KVCachePool("auto", cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, 2, page_size=PAGE_SIZE,
                       device="cpu", model_dtype=torch.float32)
    with torch.no_grad():
        hidden = model(ids, torch.arange(40), build_metadata([40], [40], PAGE_SIZE), ReferenceAttentionBackend(pool))
        logits = model.compute_logits(hidden)
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ref = hf(ids[None]).logits[0].float()
    assert torch.isfinite(logits).all() and logits.std() > 0
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)


def test_kernel_bench_replays_cycle_sets_to_min_calls() -> None:
    # every format's replay holds >= MIN_CALLS calls (the first call's extra cost is shared alike), each
    # set equally often and read again only after all the others
    from ninfer.bench.kernels import MIN_CALLS, replay_sets
    for sets in range(1, 20):
        order = replay_sets(sets)
        assert len(order) >= MIN_CALLS and len(order) < MIN_CALLS + sets
        assert all(order.count(s) == len(order) // sets for s in range(sets)) and len(order) % sets == 0
        assert all(order[i] == i % sets for i in range(len(order)))
