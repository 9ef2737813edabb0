"""The reference backend's decoded-page cache attends exactly what a fresh decode of the pool gives:
every gather of an engine run with chunked prefill, multi-step decode, preemption, abort and prefix
reuse is checked against the uncached decode, for every KV format."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.attention.reference import ReferenceAttentionBackend
from ninfer.kvcache.formats import format_names


@pytest.mark.parametrize("kv_dtype", format_names())
def test_cached_pages_equal_fresh_decode(tiny_model_dir: Path, kv_dtype: str, monkeypatch) -> None:
    seen = {"calls": 0, "cached_rows": 0, "fresh_rows": 0}
    cached = ReferenceAttentionBackend.gather_kv

    def checked(self, layer, pages, seq_len):
        decode, rows = self.fmt.decode, [0]

        def counting(data, *a, **kw):
            rows[0] += data.numel() // data.shape[-1]
            return decode(data, *a, **kw)

        self.fmt.decode = counting
        try:
            k, v = cached(self, layer, pages, seq_len)
        finally:
            del self.fmt.decode
        k0, v0 = self.gather(layer, "k", pages, seq_len), self.gather(layer, "v", pages, seq_len)
        assert torch.equal(k, k0) and torch.equal(v, v0), f"layer {layer}: cached pages differ from the pool"
        seen["calls"] += 1
        seen["cached_rows"] += rows[0]
        seen["fresh_rows"] += 2 * k0.shape[0] * seq_len
        return k, v

    monkeypatch.setattr(ReferenceAttentionBackend, "gather_kv", checked)
    # 256 tokens of pool for requests growing to ~130 tokens each: preemption; 40-token chunks
    llm = LLM(str(tiny_model_dir), kv_dtype=kv_dtype, device="cpu", max_context=256, kv_capacity=256,
              max_num_batched_tokens=40)
    eng = llm.engine
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(4, 380, (70,), generator=gen).tolist()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((90, 60, 30)):
        eng.add_request(f"a{i}", torch.randint(4, 380, (n,), generator=gen).tolist(), params)
    eng.add_request("p0", prefix + [5, 6, 7], params)
    for step in range(400):
        if step == 6:
            eng.abort_request("a1")
        if step == 30:  # shares p0's full first page once p0 has computed it
            eng.add_request("p1", prefix + [9, 10], params)
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests()
    assert eng.stats().num_preemptions > 0
    assert seen["calls"] > 100
    assert seen["cached_rows"] < seen["fresh_rows"], seen


def test_cache_decodes_only_written_pages(tiny_model_dir: Path, monkeypatch) -> None:
    """Long decode: the cache decodes several times fewer rows than decoding every page each step, and
    gives the same tokens and logprobs as cache_pages=False."""
    prompts = [torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (200, 130)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=2)
    outs, rows = [], []
    for flag in (True, False):
        monkeypatch.setattr(ReferenceAttentionBackend, "cache_pages", flag)
        llm = LLM(str(tiny_model_dir), kv_dtype="rk4v4-e8", device="cpu", max_context=512, kv_capacity=2048)
        fmt, count = llm.engine.pool.fmt, [0]
        fmt_decode = type(fmt).decode

        def counting(self, data, *a, count=count, **kw):
            count[0] += data.numel() // data.shape[-1]
            return fmt_decode(self, data, *a, **kw)

        monkeypatch.setattr(type(fmt), "decode", counting)
        outs.append([(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)])
        monkeypatch.setattr(type(fmt), "decode", fmt_decode)
        rows.append(count[0])
    assert outs[0] == outs[1]
    assert rows[0] * 2 < rows[1], rows
