"""Memory planner: bytes per token per format, every reservation term against hand arithmetic,
refusal numbers, the largest context that fits, the capacity line, the prefill chunk the planner
picks ("auto"), and `ninfer plan` exit codes."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from ninfer import cli
from ninfer.kvcache.planner import (GiB, ContextDoesNotFit, activation_workspace, cuda_graph_batch_sizes,
                                    device_memory, format_bytes, kv_bytes_per_token, plan_memory)
from ninfer.model_config import ModelConfig

DENSE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
             intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, max_position_embeddings=40960, torch_dtype="bfloat16")
# 64 layers, full attention every 4th: 16 KV layers x 4 KV heads x D256 (the seed's 27B geometry).
HYBRID = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1000, hidden_size=2048,
              intermediate_size=4096, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
              head_dim=256, full_attention_interval=4, max_position_embeddings=262144)
# Small numbers so every term can be computed by hand below.
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000, hidden_size=1024,
            intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            max_position_embeddings=131072, tie_word_embeddings=True, torch_dtype="bfloat16")
HALF_GIB = GiB // 2


def tiny_plan(**kw):
    args = dict(kv_dtype="rk4v4-e8", total_bytes=HALF_GIB, free_bytes=HALF_GIB, max_context=131072,
                max_num_seqs=4, max_num_batched_tokens=256, device_type="cpu")
    return plan_memory(ModelConfig.from_dict(TINY), **{**args, **kw})


@pytest.mark.parametrize("kv,expected", [("bf16", 147_456), ("auto", 147_456), ("int8", 76_032),
                                         ("rk4v4", 39_168), ("rk4v4-e8", 39_168)])
def test_bytes_per_token_dense(kv, expected):
    assert kv_bytes_per_token(ModelConfig.from_dict(DENSE), kv) == expected


@pytest.mark.parametrize("kv,expected", [("bf16", 65_536), ("int8", 33_792), ("rk4v4-e8", 17_408)])
def test_bytes_per_token_hybrid_counts_only_full_attention_layers(kv, expected):
    m = ModelConfig.from_dict(HYBRID)
    assert m.num_kv_layers == 16
    assert kv_bytes_per_token(m, kv) == expected
    plan = plan_memory(m, kv_dtype=kv, total_bytes=80 * GiB, free_bytes=80 * GiB, max_context=65536)
    assert plan.num_kv_layers == 16 and plan.bytes_per_token == expected
    assert plan.kv_bytes == plan.num_pages * 64 * expected


def test_workspace_by_hand():
    # T=256 tokens, S=4 seqs, bf16 (2 B): H=1024, I=4096, Hq=8, Hkv=2, D=128, V=1000.
    w = activation_workspace(ModelConfig.from_dict(TINY), 256, 2, 4)
    assert w["hidden"] == 2 * 256 * 1024 * 2 == 1_048_576
    attn = 256 * ((8 + 4) * 128 + (8 + 2) * 128 + 8 * 128 + 1024) * 2   # 2,490,368
    mlp = 256 * (3 * 4096 + 1024) * 2                                   # 6,815,744
    assert w["layer"] == max(attn, mlp) == 6_815_744
    assert w["kv_store"] == 4 * 256 * 2 * 128 * 4 == 1_048_576
    assert w["decode"] == 4 * 8 * 64 * 129 * 4 == 1_056_768
    assert w["logits"] == 6 * 4 * 1000 * 4 == 96_000


def test_plan_terms_by_hand():
    p = tiny_plan()
    # weights: embeddings (tied) 1000*1024 + 4 layers * (attention 2*1024*1024 + 2*1024*256,
    # MLP 3*1024*4096, 2 norms) + final norm; bf16.
    assert p.weights_bytes == 2 * (1_024_000 + 4 * (2_621_440 + 12_582_912 + 2048) + 1024) == 123_701_248
    assert p.bytes_per_token == 4 * 2 * (64 + 64 + 4 + 4) == 1088          # rk4v4-e8, D128
    assert p.page_bytes == 1088 * 64 == 69_632
    assert p.workspace_bytes == 10_065_664                                   # test_workspace_by_hand summed
    assert p.page_table_bytes == 4 * (131072 // 64) * 4 == 32_768           # 4 seqs x 2048 pages x int32
    assert not hasattr(p, "rope_table_bytes")  # cos/sin are computed per step, no table
    assert p.graph_bytes == 0                                                # CPU
    assert p.headroom_bytes == HALF_GIB // 10 == 53_687_091
    room = HALF_GIB - 123_701_248 - 10_065_664 - 53_687_091 - 32_768   # 349,384,141 for KV
    assert p.num_pages == room // 69_632 == 5017
    assert p.capacity_tokens == 5017 * 64 == 321_088 and p.kv_bytes == 5017 * 69_632
    assert p.capacity_mode == "auto"
    # Every byte is accounted for: weights + runtime + headroom + slack == free.
    assert p.weights_bytes + p.runtime_bytes + p.headroom_bytes + p.slack_bytes == p.free_bytes
    assert 0 <= p.slack_bytes < p.page_bytes
    # Largest context: (free - weights - workspace - headroom) // (page + 4 seqs x 4 B of page table)
    assert p.largest_context == (HALF_GIB - 123_701_248 - 10_065_664 - 53_687_091) // (69_632 + 16) * 64
    assert p.largest_context == 321_024


def test_refusal_gives_needed_available_and_largest():
    with pytest.raises(ContextDoesNotFit) as ei:
        tiny_plan(max_context=393216)
    e = ei.value
    assert isinstance(e, ValueError)
    needed = 123_701_248 + 10_065_664 + 53_687_091 + 4 * 6144 * 4 + 6144 * 69_632
    assert e.needed_bytes == needed == 615_371_315
    assert e.available_bytes == HALF_GIB and e.largest_context == 321_024
    msg = str(e)
    for s in ("615371315", "536870912", "321024 tokens", "rk4v4-e8", "max_context=393216"):
        assert s in msg


@pytest.mark.parametrize("kv", ["bf16", "int8", "rk4v4-e8"])
@pytest.mark.parametrize("mem_gib", [20, 24, 48, 141])
def test_largest_context_is_exactly_the_limit(kv, mem_gib):
    m = ModelConfig.from_dict(DENSE)
    kw = dict(kv_dtype=kv, total_bytes=mem_gib * GiB, free_bytes=mem_gib * GiB, max_num_seqs=8)
    largest = plan_memory(m, max_context=1024, **kw).largest_context
    assert largest % 64 == 0 and largest > 0
    p = plan_memory(m, max_context=largest, **kw)
    assert p.capacity_tokens >= largest and p.largest_context == largest
    with pytest.raises(ContextDoesNotFit) as ei:
        plan_memory(m, max_context=largest + 1, **kw)
    assert ei.value.largest_context == largest


def test_e8_holds_about_twice_the_int8_context():
    m = ModelConfig.from_dict(DENSE)
    kw = dict(total_bytes=80 * GiB, free_bytes=80 * GiB, max_context=8192)
    e8 = plan_memory(m, kv_dtype="rk4v4-e8", **kw).largest_context
    i8 = plan_memory(m, kv_dtype="int8", **kw).largest_context
    assert 1.9 < e8 / i8 < 76_032 / 39_168 + 0.01


def test_weights_that_do_not_fit_refuse_with_zero_largest():
    with pytest.raises(ContextDoesNotFit) as ei:
        tiny_plan(total_bytes=100 * 2**20, free_bytes=100 * 2**20, max_context=1024)
    assert ei.value.largest_context == 0 and "alone need" in str(ei.value)


def test_explicit_capacity():
    p = tiny_plan(kv_capacity=150_000)
    assert p.capacity_mode == "explicit" and p.num_pages == -(-150_000 // 64) == 2344
    assert p.capacity_tokens == 2344 * 64
    with pytest.raises(ValueError, match="smaller than max_context") as ei:
        tiny_plan(kv_capacity=1000)
    assert not isinstance(ei.value, ContextDoesNotFit)
    with pytest.raises(ContextDoesNotFit, match="kv_capacity=330048 tokens"):
        tiny_plan(kv_capacity=330_000)     # > 5017 pages of room


def test_auto_is_capped_at_every_sequence_full_length():
    p = tiny_plan(max_context=4096)
    assert p.num_pages == 4 * 64 and p.slack_bytes > p.page_bytes


def test_graphs_planned_only_on_cuda_with_graphs():
    m = ModelConfig.from_dict(DENSE)
    kw = dict(kv_dtype="int8", total_bytes=80 * GiB, free_bytes=80 * GiB, max_context=32768)
    assert plan_memory(m, **kw).graph_bytes > 0
    assert plan_memory(m, enforce_eager=True, **kw).graph_bytes == 0
    assert plan_memory(m, device_type="cpu", **kw).graph_bytes == 0
    assert cuda_graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert cuda_graph_batch_sizes(3) == [1, 2, 3]


def test_weights_resident_gives_the_same_plan():
    a = tiny_plan()
    b = tiny_plan(free_bytes=HALF_GIB - a.weights_bytes, weights_resident=True)
    assert a == b


def test_bad_knobs():
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        tiny_plan(kv_dtype="fp5")
    with pytest.raises(ValueError, match="rk2v4-e8"):
        tiny_plan(kv_dtype="rk2v4-e8")
    with pytest.raises(ValueError, match="max_context"):
        tiny_plan(max_context=0)
    with pytest.raises(ValueError, match="weights dtype"):
        tiny_plan(weights_dtype="int3")


X = r"-?\d+\.\d\d (?:GiB|MiB)"
LINE = re.compile(rf"^KV capacity (auto|explicit) resolved=(\d+) tokens pages=(\d+) bytes/token=(\d+) "
                  rf"runtime={X} free-after-weights={X} free-after-startup={X} headroom={X} slack={X} "
                  rf"graphs=(-|{X})/{X} prefill chunk (\d+) \((auto|explicit)\)$")


def test_capacity_line_format():
    p = tiny_plan()
    m = LINE.match(p.capacity_line())
    assert m, p.capacity_line()
    assert m.groups()[:4] == ("auto", "321088", "5017", "1088") and m.group(5) == "-"
    assert "runtime=342.79 MiB" in p.capacity_line()   # 349343744 + 32768 + 10065664 = 359442176 B
    q = p.with_observed(graph_bytes=12 * 2**20, free_after_startup=GiB + GiB // 4)
    line = q.capacity_line()
    assert LINE.match(line) and "graphs=12.00 MiB/0.00 MiB" in line and "free-after-startup=1.25 GiB" in line
    e = plan_memory(ModelConfig.from_dict(DENSE), kv_dtype="int8", total_bytes=80 * GiB, free_bytes=80 * GiB,
                    max_context=40960, kv_capacity=65536)
    assert LINE.match(e.capacity_line()).group(1) == "explicit"
    assert format_bytes(1536 * 2**20) == "1.50 GiB" and format_bytes(-3 * 2**20) == "-3.00 MiB"


def test_device_memory_cpu():
    total, free = device_memory("cpu")
    assert total > 0 and 0 < free <= total
    lim = device_memory("cpu", 0.5)
    assert lim.total == HALF_GIB and 0 < lim.free <= HALF_GIB
    with pytest.raises((ValueError, RuntimeError)):
        device_memory("meta")


# ---- ninfer plan ---------------------------------------------------------------------------------
@pytest.fixture
def dense_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    return tmp_path


def test_cli_fits(dense_dir, capsys):
    assert cli.main(["plan", str(dense_dir), "--max-context", "32K"]) == 0
    out = capsys.readouterr().out
    assert "80.00 GiB (default" in out
    for kv, bpt in (("bf16", 147456), ("int8", 76032), ("rk4v4-e8", 39168)):
        assert re.search(rf"^{re.escape(kv)}\s+{bpt}\s+\d+\s+yes$", out, re.M), out
    lines = [ln.split("] ", 1)[1] for ln in out.splitlines() if ln.startswith("[")]
    assert len(lines) == 5 and all(LINE.match(ln.split(" states=")[0]) for ln in lines)  # rk4v4-e8w: + its window


def test_cli_default_context_follows_yarn(dense_dir, capsys):
    assert cli.main(["plan", str(dense_dir), "--kv-dtype", "rk4v4-e8", "--rope-yarn-factor", "4",
                     "--memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "max_context=163840 " in out and "141.00 GiB;" in out     # 40960 x 4


def test_cli_refusal_exits_nonzero_with_numbers(dense_dir, capsys):
    rc = cli.main(["plan", str(dense_dir / "config.json"), "--memory", "24", "--max-context", "128K",
                   "--kv-dtype", "bf16"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "refused" in out and "bytes" in out and "largest context that fits with bf16 is" in out


def test_cli_json(dense_dir, capsys):
    rc = cli.main(["plan", str(dense_dir), "--memory", "24", "--max-context", "128K", "--kv-dtype", "int8,rk4v4-e8",
                   "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["memory_gib"] == 24
    rows = {r["kv_dtype"]: r for r in doc["rows"]}
    assert not rows["int8"]["fits"] and rows["int8"]["needed_bytes"] > rows["int8"]["available_bytes"]
    assert rows["rk4v4-e8"]["fits"] and rows["rk4v4-e8"]["plan"]["bytes_per_token"] == 39168


def test_cli_bad_input(tmp_path, dense_dir, capsys):
    assert cli.main(["plan", str(tmp_path / "missing")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["plan", str(bad)]) == 2
    bad.write_text("[1, 2]")
    assert cli.main(["plan", str(bad)]) == 2
    bad.write_text(json.dumps({k: v for k, v in DENSE.items() if k != "hidden_size"}))
    assert cli.main(["plan", str(bad)]) == 2
    assert cli.main(["plan", str(dense_dir), "--kv-dtype", "fp5"]) == 2
    assert cli.main(["plan", str(dense_dir), "--kv-dtype", "rk2v4-e8"]) == 2
    err = capsys.readouterr().err
    for s in ("no config.json", "not valid JSON", "not a JSON object", "lacks required field 'hidden_size'",
              "unknown kv_dtype", "refused"):
        assert s in err


def test_cli_subprocess(dense_dir):
    r = subprocess.run([sys.executable, "-m", "ninfer", "plan", str(dense_dir), "--kv-dtype", "rk4v4-e8",
                        "--memory", "20", "--max-context", "1M"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "refused" in r.stdout


# The prefill chunk the planner picks ("auto"): DENSE (Qwen3-8B geometry), bf16, rk4v4-e8, 128K context.
# Workspace per token of chunk: hidden 2*4096*2 + layer max(attn, mlp = (3*12288 + 4096)*2) + kv_store
# 4*8*128*4, plus the SDPA prefill's 32*128*(5*2 + 8) + 3*32*4 (its K/V term is fixed below 128K tokens).
WS_PER_TOKEN = 2 * 4096 * 2 + (3 * 12288 + 4096) * 2 + 4 * 8 * 128 * 4 + 32 * 128 * (5 * 2 + 8) + 3 * 32 * 4


def chunk_plan(mem_gib, **kw):
    args = dict(kv_dtype="rk4v4-e8", total_bytes=mem_gib * GiB, free_bytes=mem_gib * GiB, max_context=131072)
    return plan_memory(ModelConfig.from_dict(DENSE), **{**args, **kw})


@pytest.mark.parametrize("mem_gib,expected", [(256, 32768), (141, 16384), (40, 8192)])
def test_auto_prefill_chunk(mem_gib, expected):
    assert WS_PER_TOKEN == 188_800
    base = chunk_plan(mem_gib, max_num_batched_tokens=8192)
    for n in (16384, 32768):  # the workspace grows by exactly the hand-computed bytes per token
        assert chunk_plan(mem_gib, max_num_batched_tokens=n).workspace_bytes - base.workspace_bytes \
            == (n - 8192) * WS_PER_TOKEN
    # the rule by hand: the largest chunk whose extra workspace is at most 2% of the 8K plan's KV pool
    ok = [n for n in (32768, 16384) if (n - 8192) * WS_PER_TOKEN <= 0.02 * base.kv_bytes]
    assert (ok[0] if ok else 8192) == expected
    p = chunk_plan(mem_gib)
    assert (p.max_num_batched_tokens, p.prefill_chunk_mode) == (expected, "auto")
    assert p == replace(chunk_plan(mem_gib, max_num_batched_tokens=expected), prefill_chunk_mode="auto")
    assert p.capacity_line().endswith(f" prefill chunk {expected} (auto)")


def test_auto_prefill_chunk_limits():
    # an explicit chunk wins, whatever the memory
    p = chunk_plan(256, max_num_batched_tokens=8192)
    assert (p.max_num_batched_tokens, p.prefill_chunk_mode) == (8192, "explicit")
    assert p.capacity_line().endswith(" prefill chunk 8192 (explicit)")
    assert chunk_plan(40, max_num_batched_tokens=32768).max_num_batched_tokens == 32768
    # never more than the context needs (rounded up to a page; a pool of 256 x 12032 tokens, 2% of it
    # > 3840 x WS_PER_TOKEN); never below 8192. With 64 sequences that pool is too small for 12032.
    assert chunk_plan(256, max_context=12000, max_num_seqs=256).max_num_batched_tokens == 12032
    assert chunk_plan(256, max_context=12000).max_num_batched_tokens == 8192
    assert chunk_plan(256, max_context=4096).max_num_batched_tokens == 8192
    # CPU: 8192
    assert chunk_plan(256, device_type="cpu").max_num_batched_tokens == 8192
    # a chunk whose workspace pushes the context out is skipped, not refused (32K does not fit here)
    with pytest.raises(ContextDoesNotFit):
        chunk_plan(24, max_context=90016, max_num_batched_tokens=32768)
    assert chunk_plan(24, max_context=90016).max_num_batched_tokens == 8192
    with pytest.raises(ContextDoesNotFit):  # and when even 8192 does not fit, the refusal stays
        chunk_plan(16, max_context=90016)


def test_cli_shows_prefill_chunk(dense_dir, capsys):
    assert cli.main(["plan", str(dense_dir), "--kv-dtype", "rk4v4-e8", "--memory", "141", "--max-context", "128K"]) == 0
    out = capsys.readouterr().out
    assert "prefill_chunk=auto" in out and out.rstrip().endswith("prefill chunk 16384 (auto)"), out
    assert cli.main(["plan", str(dense_dir), "--kv-dtype", "rk4v4-e8", "--memory", "141", "--max-context", "128K",
                     "--prefill-chunk", "32k"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("prefill chunk 32768 (explicit)")


def test_engine_takes_the_planned_chunk():
    import argparse

    from ninfer import LLM
    from ninfer.config import EngineConfig, add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineConfig().max_num_batched_tokens == "auto"
    assert engine_config_from_args(p.parse_args([])).max_num_batched_tokens == "auto"
    assert engine_config_from_args(p.parse_args(["--prefill-chunk", "16k"])).max_num_batched_tokens == 16384
    for given, want, mode in (("auto", 8192, "auto"), (96, 96, "explicit")):  # CPU: auto is 8192
        eng = LLM(None, kv_dtype="bf16", device="cpu", max_context=128, max_num_batched_tokens=given).engine
        assert eng.scheduler.max_num_batched_tokens == eng.plan.max_num_batched_tokens == want
        assert any(x.endswith(f"prefill chunk {want} ({mode})") for x in eng.startup_lines), eng.startup_lines
        assert any(f"max_num_batched_tokens={want} " in x for x in eng.startup_lines), eng.startup_lines
