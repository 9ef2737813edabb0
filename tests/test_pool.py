"""KV pool: planes allocated from the format entry for every format, bytes as planned, and the
geometry assertion refuses full-width planes for a packed format (DESIGN §2.2)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer.kvcache.formats import FORMAT_NAMES, Plane, get_format
from ninfer.kvcache.planner import GiB, plan_memory
from ninfer.kvcache.pool import GeometryError, KVCachePool
from ninfer.model_config import ModelConfig

# (data dtype, data extent, scale extent or None) per format, for head_dim D, bf16 model.
EXPECTED = {
    "auto": (torch.bfloat16, lambda d: d, None),
    "bf16": (torch.bfloat16, lambda d: d, None),
    "int8": (torch.int8, lambda d: d, lambda d: d // 64),
    "rk4v4": (torch.uint8, lambda d: d // 2, lambda d: d // 64),
    "rk4v4-e8": (torch.uint8, lambda d: d // 2, lambda d: d // 64),
    "rk4v4-e8w": (torch.uint8, lambda d: d // 2, lambda d: d // 64),  # the pages of rk4v4-e8
}


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_geometry_every_format(name, head_dim):
    pool = KVCachePool(name, num_layers=3, num_kv_heads=2, head_dim=head_dim, num_pages=5)
    pool.assert_geometry()
    dt, ext, sc = EXPECTED[name]
    assert len(pool.layers) == 3
    for layer in pool.layers:
        assert set(layer) == ({"k", "v", "k_scale", "v_scale"} if sc else {"k", "v"})
        for kv in ("k", "v"):
            assert layer[kv].dtype == dt and tuple(layer[kv].shape) == (5, 2, 64, ext(head_dim))
            if sc:
                s = layer[f"{kv}_scale"]
                assert s.dtype == torch.float16 and tuple(s.shape) == (5, 2, 64, sc(head_dim))
    per_head = get_format(name).bytes_per_token_head(head_dim)
    assert pool.bytes_allocated == 3 * 2 * 5 * 64 * per_head == pool.bytes_per_token * pool.capacity_tokens
    lines = pool.geometry_lines()
    assert lines[0].startswith(f"kv planes: kv_dtype={name} ") and f"extent={head_dim}->{ext(head_dim)}" in lines[0]
    assert f"allocated={pool.bytes_allocated}" in lines[1]


def test_e8_line_matches_design():
    pool = KVCachePool(get_format("rk4v4-e8"), 2, 4, 256, 3)
    assert pool.geometry_lines()[0].startswith(
        "kv planes: kv_dtype=rk4v4-e8 packed_k=1 packed_v=1 e8_lattice=1 e8_root=0 extent=256->128 "
        "dtype=uint8 scales=fp16x4")


def test_slot_addressing_and_zero_fill():
    pool = KVCachePool("int8", 1, 2, 64, 4)
    assert all(int(t.abs().sum()) == 0 for t in pool.layers[0].values())
    slot = 2 * 64 + 5                                   # page 2, offset 5
    pool.layers[0]["k"][slot // 64, :, slot % 64] = 7
    assert int(pool.layers[0]["k"].view(4 * 2 * 64, 64)[(2 * 2) * 64 + 5, 0]) == 7


def test_full_width_planes_for_a_packed_format_are_refused():
    pool = KVCachePool("rk4v4-e8", 2, 2, 128, 3)
    # Someone allocates the K plane at full width: every shape check downstream would still "work".
    pool.layers[1]["k"] = torch.zeros((3, 2, 64, 128), dtype=torch.uint8)
    with pytest.raises(GeometryError, match="plane k"):
        pool.assert_geometry()


def test_missing_or_aliased_planes_are_refused():
    pool = KVCachePool("int8", 2, 2, 64, 3)
    del pool.layers[0]["v_scale"]
    with pytest.raises(GeometryError, match="planes"):
        pool.assert_geometry()
    pool = KVCachePool("bf16", 2, 2, 64, 3)
    pool.layers[1]["v"] = pool.layers[1]["k"]
    with pytest.raises(GeometryError, match="aliases"):
        pool.assert_geometry()


def test_a_format_entry_that_claims_packing_but_is_full_width_is_refused():
    real = get_format("rk4v4-e8")

    class FullWidth:
        name, rotated, packed, e8_lattice, has_scales = real.name, True, True, True, True

        def planes(self, head_dim, model_dtype=torch.bfloat16):
            return tuple(dataclasses.replace(p, extent=head_dim) if p.name in ("k", "v") else p
                         for p in real.planes(head_dim, model_dtype))

        def bytes_per_token_head(self, head_dim, model_dtype=torch.bfloat16):
            return sum(p.extent * torch.empty((), dtype=p.dtype).element_size() for p in self.planes(head_dim))

        def geometry_line(self, head_dim, model_dtype=torch.bfloat16, allocated=None):
            return "kv planes: fake"

    pool = KVCachePool(FullWidth(), 1, 1, 128, 2)
    with pytest.raises(GeometryError, match="8 bits per k coordinate, not 4"):
        pool.assert_geometry()
    assert isinstance(real.planes(128)[0], Plane)


@pytest.mark.parametrize("kv", ["bf16", "int8", "rk4v4-e8"])
def test_pool_from_plan_allocates_exactly_the_planned_kv_bytes(kv):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=128,
               intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, max_position_embeddings=4096)
    plan = plan_memory(ModelConfig.from_dict(cfg), kv_dtype=kv, total_bytes=GiB // 8, free_bytes=GiB // 8,
                       max_context=1024, max_num_seqs=2, max_num_batched_tokens=256, device_type="cpu")
    pool = KVCachePool.from_plan(plan, "cpu")
    pool.assert_geometry()
    assert pool.bytes_allocated == plan.kv_bytes and pool.capacity_tokens == plan.capacity_tokens


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_pages"):
        KVCachePool("int8", 1, 1, 64, 0)
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        KVCachePool("fp5", 1, 1, 64, 1)
