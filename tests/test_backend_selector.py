"""The attention backend chosen once (ninfer/attention/selector.py): which implementation serves each
op and the reason line, forced choices, refusals, registering an implementation, and the per-step
plan (decode splits computed once per batch shape, not per layer). CPU only: the Triton path is
selectable under TRITON_INTERPRET=1 (the selection reads it; nothing here launches a kernel), and
the CUDA paths' reasons are computed with the device stubbed (tests/test_kernel_store_cuda.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer.attention import selector as sel
from ninfer.attention.base import StepMetadata
from ninfer.attention.selector import OpImpl, UnsupportedAttention, register_op, select_backend
from ninfer.kvcache.formats import get_format
from ninfer.kvcache.pool import KVCachePool


def _pool(fmt="rk4v4-e8", d=128, device="cpu"):
    return SimpleNamespace(fmt=get_format(fmt), device=torch.device(device), head_dim=d, num_kv_heads=2,
                           page_size=64, model_dtype=torch.bfloat16)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def impls(monkeypatch):
    """OP_IMPLS restored after the test (register_op edits it)."""
    monkeypatch.setattr(sel, "OP_IMPLS", {op: list(v) for op, v in sel.OP_IMPLS.items()})
    return sel.OP_IMPLS


def test_cpu_default_is_the_reference_backend():
    be = select_backend(KVCachePool("int8", 1, 2, 64, 2), "cpu", torch.bfloat16, 4)
    assert be.name == "reference" and be.kernel_paths() == "reference"
    assert select_backend(_pool(), "cuda", torch.bfloat16, 4, kind="reference").name == "reference"
    with pytest.raises(ValueError, match="backend kind"):
        select_backend(_pool(), "cpu", torch.bfloat16, 4, kind="fast")


def test_kernels_on_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnsupportedAttention, match=r"no store implementation serves kv_dtype=rk4v4-e8 on cpu .*"
                                                   r"cuda: not on CUDA; triton: Triton needs CUDA"):
        select_backend(_pool(), "cpu", torch.bfloat16, 4, kind="kernels")


def test_kernel_paths_say_what_serves_each_op_and_why(interpret):
    be = select_backend(_pool(), "cpu", torch.bfloat16, 4, kind="kernels")
    assert be.name == "kernels"
    assert be.kernel_paths() == "store=triton (not on CUDA) decode=triton (not on CUDA) prefill=sdpa"
    bf = select_backend(_pool("bf16", 96), "cpu", torch.bfloat16, 4, kind="kernels")
    assert bf.kernel_paths() == ("store=triton (format bf16 has no cuda store kernel) decode=triton (format bf16 "
                                 "has no cuda decode kernel) prefill=triton (head_dim 96: the SDPA prefill needs "
                                 "a power of 2 in 64..256)")
    # a rotated format's prefill kernel needs a power-of-2 head dim: refused at startup, not mid-serving
    with pytest.raises(UnsupportedAttention, match=r"no prefill implementation .* head_dim 192 \(rotated formats"):
        select_backend(_pool("rk4v4", 192), "cpu", torch.bfloat16, 4, kind="kernels")


def test_forced_choices(interpret):
    be = select_backend(_pool(), "cpu", torch.bfloat16, 4, force={"decode": "triton"})
    assert be.ops["decode"].impl.name == "triton" and be.ops["decode"].note == ""
    with pytest.raises(UnsupportedAttention, match="no decode implementation .*: cuda: not on CUDA"):
        select_backend(_pool(), "cpu", torch.bfloat16, 4, force={"decode": "cuda"})
    with pytest.raises(ValueError, match="no decode implementation named 'cudnn'; have cuda, triton"):
        select_backend(_pool(), "cpu", torch.bfloat16, 4, force={"decode": "cudnn"})
    with pytest.raises(ValueError, match="unknown attention op"):
        select_backend(_pool(), "cpu", torch.bfloat16, 4, force={"merge": "triton"})


def test_a_registered_implementation_is_preferred_and_a_broken_one_skipped(interpret, impls):
    calls = []

    def bind(ctx):
        def prefill(q, planes, meta, scale):
            calls.append(q.shape)
            return q
        return prefill

    from ninfer.kvcache.formats import KERNEL_E8, KERNEL_INT8

    register_op(OpImpl("prefill", "sdpa", lambda ctx: None if ctx.head_dim <= 128 else "head_dim > 128", bind,
                       formats=frozenset({KERNEL_E8, KERNEL_INT8})))  # declares the formats it has kernels for
    be = select_backend(_pool(), "cpu", torch.bfloat16, 4, kind="kernels")
    assert be.kernel_paths().endswith("prefill=sdpa") and [i.name for i in impls["prefill"]] == ["sdpa", "triton"]
    assert select_backend(_pool("bf16"), "cpu", torch.bfloat16, 4, kind="kernels").kernel_paths().endswith(
        "prefill=triton (format bf16 has no sdpa prefill kernel)")
    assert select_backend(_pool("int8", 256), "cpu", torch.bfloat16, 4, kind="kernels").kernel_paths().endswith(
        "prefill=triton (head_dim > 128)")

    def broken(ctx):
        raise RuntimeError("nvcc exploded")

    register_op(OpImpl("prefill", "sdpa", lambda ctx: None, broken))  # same name: replaces it
    assert [i.name for i in impls["prefill"]] == ["sdpa", "triton"]
    assert select_backend(_pool(), "cpu", torch.bfloat16, 4, kind="kernels").kernel_paths().endswith(
        "prefill=triton (failed to load: RuntimeError: nvcc exploded)")
    with pytest.raises(ValueError, match="unknown attention op"):
        register_op(OpImpl("merge", "x", lambda ctx: None, bind))
    with pytest.raises(ValueError, match="needs num_splits"):
        register_op(OpImpl("decode", "x", lambda ctx: None, bind))


def _meta(b, width, decode=True):
    return StepMetadata(slot_mapping=torch.full((b,), -1), query_start_loc=torch.arange(b + 1, dtype=torch.int32),
                        seq_lens=torch.ones(b, dtype=torch.int32),
                        block_tables=torch.zeros(b, width, dtype=torch.int32),
                        max_query_len=1, max_seq_len=1, is_decode=decode)


def test_plan_computes_decode_splits_once_per_shape(interpret, impls):
    rule, seen = [], []

    def splits(ctx, batch, width):
        rule.append((batch, width))
        return 3 + batch

    def bind(ctx):
        def decode(q, planes, block_tables, seq_lens, scale, num_splits):
            seen.append(num_splits)
            return q
        return decode

    register_op(OpImpl("decode", "probe", lambda ctx: None, bind, num_splits=splits))
    pool = KVCachePool("bf16", 2, 2, 64, 2)
    be = select_backend(pool, "cpu", torch.bfloat16, 2, force={"store": "triton", "decode": "probe"})
    be._store = lambda *a: None  # nothing to store: only the plan is under test
    q = torch.zeros(2, 2, 64)
    for step in range(3):
        meta = _meta(2, 8)
        be.plan(meta)
        for layer in (0, 1):  # every layer reuses the step's plan
            be.forward(layer, q, q, q, meta, 0.1)
    meta = _meta(2, 16)  # a new shape: planned lazily by the first layer when the caller did not
    be.forward(0, q, q, q, meta, 0.1)
    assert rule == [(2, 8), (2, 16)] and seen == [5] * 7
    assert be.plan(_meta(3, 8, decode=False)) == 0
    fixed = select_backend(pool, "cpu", torch.bfloat16, 2, force={"decode": "probe"}, num_splits=7)
    assert fixed.plan(_meta(2, 8)) == 7
