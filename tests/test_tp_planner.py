"""Planner under tensor parallelism: one rank's weight shard, KV bytes per token and recurrent
states against hand arithmetic; the per-rank plan of a small model term by term; the model a rank
builds agrees with the planner (its parameters, its cache spec); one rank is the plan without
tensor parallelism; `ninfer plan -tp N` prints the per-rank table and refuses what N cannot split."""
from __future__ import annotations

import json

import pytest
import torch

from ninfer import cli
from ninfer.engine.engine import declared_cache_spec
from ninfer.kvcache.formats import get_format
from ninfer.kvcache.planner import GiB, default_cache_spec, plan_memory
from ninfer.layers.tp_geometry import local_config, shard_param_count
from ninfer.model_config import ConfigError, ModelConfig

DENSE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
             intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, max_position_embeddings=40960, torch_dtype="bfloat16")
# Qwen3.5-27B's geometry: 16 gated-attention layers (every 4th), 48 GDN layers.
HYBRID = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120,
              intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
              head_dim=256, full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=48,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              max_position_embeddings=262144, torch_dtype="bfloat16")
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000, hidden_size=1024,
            intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            max_position_embeddings=131072, tie_word_embeddings=True, torch_dtype="bfloat16")


def _plan(cfg: dict, tp: int, **kw):
    args = dict(kv_dtype="bf16", total_bytes=140 * GiB, free_bytes=140 * GiB, max_context=32768, max_num_seqs=8,
                max_num_batched_tokens=2048, device_type="cuda")
    return plan_memory(ModelConfig.from_dict(cfg), **{**args, **kw}, tensor_parallel_size=tp)



@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_dense_weight_shard_by_hand(tp: int) -> None:
    # per layer: q|k|v 4096 x (4096 + 2*1024) and o_proj 4096 x 4096 and the MLP 3 x 4096 x 12288 split
    # by N; q/k norms (2 x 128) and the two layer norms (2 x 4096) whole. Embedding and lm_head: 151936 / N
    # rows of 4096 each; the final norm whole.
    layer = (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 12288) // tp + 256 + 8192
    params = 36 * layer + 2 * (151936 // tp) * 4096 + 4096
    assert shard_param_count(ModelConfig.from_dict(DENSE), tp) == params
    assert _plan(DENSE, tp).weights_bytes == 2 * params
    if tp == 1:
        assert params == ModelConfig.from_dict(DENSE).num_params() == 8_190_735_360


def test_padded_vocabulary_rows() -> None:
    # 151937 rows over 2 ranks: 75969 each (the last rank's final row is padding)
    odd = ModelConfig.from_dict({**DENSE, "vocab_size": 151937})
    assert shard_param_count(odd, 2) - shard_param_count(ModelConfig.from_dict(DENSE), 2) == 2 * 4096


@pytest.mark.parametrize("kv,per_head", [("bf16", 2 * 128 * 2), ("int8", 2 * (128 + 2 * 2)),
                                         ("rk4v4-e8", 2 * (128 // 2 + 2 * 2))])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_kv_bytes_per_token_per_rank(kv: str, per_head: int, tp: int) -> None:
    # K + V per KV head: bf16 2 B x 128; int8 1 B x 128 + an fp16 scale per 64; rk4v4-e8 4 bits x 128 + fp16 scales
    p = _plan(DENSE, tp, kv_dtype=kv)
    assert p.bytes_per_token == per_head * (8 // tp) * 36
    assert p.num_kv_heads == 8 // tp and p.kv_bytes == p.num_pages * p.page_size * p.bytes_per_token


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hybrid_kv_and_states_per_rank(tp: int) -> None:
    p = _plan(HYBRID, tp)
    assert p.bytes_per_token == 16 * (4 // tp) * 2 * 256 * 2
    # per GDN layer, float32: the conv window 3 x (2 x 16/N key heads x 128 + 48/N value heads x 128)
    # and the delta-rule state 48/N x 128 x 128
    conv = 3 * (2 * (16 // tp) * 128 + (48 // tp) * 128) * 4
    ssm = (48 // tp) * 128 * 128 * 4
    assert p.state_bytes_per_seq == 48 * (conv + ssm)
    assert p.state_bytes == 8 * 48 * (conv + ssm)
    if tp == 2:
        assert p.state_bytes_per_seq == 48 * (61_440 + 1_572_864)


def test_small_plan_per_rank_by_hand() -> None:
    """TINY on a quarter-GiB CPU device at tp=2, every term as test_planner's tp=1 version."""
    p = plan_memory(ModelConfig.from_dict(TINY), kv_dtype="rk4v4-e8", total_bytes=GiB // 4, free_bytes=GiB // 4,
                    max_context=131072, max_num_seqs=4, max_num_batched_tokens=256, device_type="cpu",
                    tensor_parallel_size=2)
    # 500 tied embedding rows; per layer q|k|v 1024 x (4+1+1) x 128 + o_proj 512 x 1024, MLP 3 x 1024 x 2048, 2 norms
    assert p.weights_bytes == 2 * (500 * 1024 + 4 * (786_432 + 524_288 + 6_291_456 + 2048) + 1024) == 61_859_840
    assert p.bytes_per_token == 4 * 1 * 2 * (64 + 4) == 544 and p.page_bytes == 544 * 64
    hidden = 2 * 256 * 1024 * 2
    mlp = 256 * (3 * 2048 + 1024) * 2                       # > attention 256 * (6 + 5 + 4) * 128 * 2 + ...
    kv_store, decode, logits = 4 * 256 * 1 * 128 * 4, 4 * 4 * 64 * 129 * 4, 6 * 4 * 1000 * 4  # the full vocabulary
    assert p.workspace_bytes == hidden + mlp + kv_store + decode + logits == 5_867_264
    headroom = (GiB // 4) // 10
    room = GiB // 4 - 61_859_840 - 5_867_264 - headroom - 4 * 2048 * 4
    assert p.num_pages == room // 34_816 == 4992
    assert p.largest_context == (GiB // 4 - 61_859_840 - 5_867_264 - headroom) // (34_816 + 16) * 64 == 319_424
    assert p.weights_bytes + p.runtime_bytes + p.headroom_bytes + p.slack_bytes == p.free_bytes
    line = p.capacity_line()
    assert line.startswith("KV capacity auto resolved=319488 tokens pages=4992 bytes/token=544 ")
    # group: 2 x 61,859,840 B of weights, 2 x 4992 pages x 34,816 B of KV
    assert line.endswith("; per rank of tensor-parallel 2, group: bytes/token=1088 weights=117.99 MiB "
                         "kv=331.50 MiB")
    assert p.as_dict()["tensor_parallel_size"] == 2


@pytest.mark.parametrize("cfg", [DENSE, HYBRID, TINY], ids=["dense", "hybrid", "tiny"])
def test_one_rank_is_the_plan_without_tensor_parallel(cfg: dict) -> None:
    mc = ModelConfig.from_dict(cfg)
    args = dict(kv_dtype="rk4v4-e8", total_bytes=80 * GiB, free_bytes=80 * GiB, max_context=16384)
    p = plan_memory(mc, **args)
    assert plan_memory(mc, **args, tensor_parallel_size=1) == p
    assert local_config(mc, 1) is mc and p.weights_bytes == mc.weight_bytes("bf16")
    assert "tensor-parallel" not in p.capacity_line() and "per rank" not in p.summary_lines()[0]


@pytest.mark.parametrize("cfg,tp", [(DENSE, 2), (DENSE, 8), (HYBRID, 2), (HYBRID, 4), (TINY, 2)],
                         ids=["dense2", "dense8", "hybrid2", "hybrid4", "tiny2"])
def test_a_ranks_model_is_what_the_planner_counts(cfg: dict, tp: int, as_rank) -> None:
    """The model a rank builds (on the meta device, at the last rank): its parameters are the
    planner's shard, its cache spec the planner's per-rank spec, in every format."""
    from ninfer.models.registry import get_model_class
    mc = ModelConfig.from_dict(cfg)
    as_rank(tp - 1, tp)
    with torch.device("meta"):
        model = get_model_class(mc.architecture)(mc)
    assert sum(p.numel() for p in model.parameters()) == shard_param_count(mc, tp)
    for kv in ("bf16", "int8", "rk4v4-e8"):
        assert declared_cache_spec(mc, get_format(kv)) == default_cache_spec(local_config(mc, tp), kv)
    assert model.local_heads == (mc.num_heads // tp, mc.num_kv_heads // tp)


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="tensor-parallel-size 3 does not divide the 8 KV heads"):
        _plan(DENSE, 3)
    with pytest.raises(ConfigError, match="tensor-parallel-size 16 exceeds the 8 KV heads"):
        _plan(DENSE, 16)
    # 4 KV heads, 24 q heads, but 16 GDN key heads and 48 value heads: 8 does not divide 4 KV heads
    with pytest.raises(ConfigError, match="exceeds the 4 KV heads"):
        _plan(HYBRID, 8)
    with pytest.raises(ConfigError, match="does not divide the 6 linear-attention key heads"):
        _plan({**HYBRID, "linear_num_key_heads": 6}, 4)
    spec = default_cache_spec(ModelConfig.from_dict(DENSE), "bf16")  # the whole model's 8 KV heads
    with pytest.raises(ValueError, match="the cache spec has 8 KV heads, a rank of tensor-parallel 2 holds 4"):
        _plan(DENSE, 2, cache_spec=spec)


@pytest.fixture
def dense_dir(tmp_path):
    d = tmp_path / "Qwen3-8B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DENSE))
    return d


def test_cli_per_rank_table(dense_dir, capsys) -> None:
    assert cli.main(["plan", str(dense_dir), "-tp", "2", "--kv-dtype", "bf16,rk4v4-e8", "--memory", "140"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 2 ranks; every number below is one rank's (kv-heads=4 heads=16 per rank)" in out
    assert "weights: 7.63 GiB per rank, 15.26 GiB for the group" in out
    assert "device memory: 140.00 GiB per rank" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith(("bf16 ", "rk4v4-e8 "))}
    assert rows == {"bf16": str(256 * 2 * 4 * 36), "rk4v4-e8": str(136 * 4 * 36)}
    assert out.count("per rank of tensor-parallel 2, group: bytes/token=") == 2
    assert cli.main(["plan", str(dense_dir), "--tensor-parallel-size", "2", "--kv-dtype", "bf16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensor_parallel_size"] == 2 and data["rows"][0]["plan"]["num_kv_heads"] == 4


def test_cli_refuses_a_size_that_does_not_divide(dense_dir, capsys) -> None:
    assert cli.main(["plan", str(dense_dir), "-tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "ninfer plan: error: tensor-parallel-size 3 does not divide the 8 KV heads of Qwen3-8B\n"
