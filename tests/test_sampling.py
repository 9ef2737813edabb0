"""SamplingParams validation, the sampler's filters and penalties, seeds, stop conditions
(EOS, stop tokens, stop strings, max_tokens), incremental detokenization, logprobs, and the
NaN/Inf guard, on the sampler alone and through the engine with a tiny random model."""
from __future__ import annotations

import math

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.detokenizer import IncrementalDetokenizer
from ninfer.engine.request import Request
from ninfer.engine.sampling import SampleRow, sample


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint()), kv_dtype="auto", device="cpu", max_context=512, kv_capacity=4096)


def row(params: SamplingParams, seed: int = 0, prompt=(), output=(), banned=()) -> SampleRow:
    g = torch.Generator().manual_seed(seed)
    return SampleRow(params, g, list(prompt), list(output), list(banned))


# ---------------------------------------------------------------------------- parameters

@pytest.mark.parametrize("kw, needle", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"), (dict(seed="x"), "seed"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_params_raise(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


def test_param_normalization() -> None:
    p = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert p.stop == ["END"] and p.top_k == 0 and p.greedy
    assert SamplingParams().max_tokens == 16 and not SamplingParams().greedy


# ---------------------------------------------------------------------------- the sampler

def test_filters_reduce_to_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                   SamplingParams(min_p=1.0)):
        rows = [row(params, seed=i) for i in range(4)]
        assert sample(logits.clone(), rows).token_ids == best, params


def test_distribution_and_support() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 4000
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(6)
    for _ in range(n):
        counts[sample(logits, [SampleRow(SamplingParams(temperature=1.0), g, [], [], [])]).token_ids[0]] += 1
    probs = torch.softmax(logits[0], -1)
    assert torch.allclose(counts / n, probs, atol=0.03), (counts / n, probs)
    # temperature sharpens, top-k / top-p / min-p cut the tail
    for params, allowed in ((SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.6), {0, 1}),
                            (SamplingParams(min_p=0.3), {0, 1})):
        seen = {sample(logits, [SampleRow(params, g, [], [], [])]).token_ids[0] for _ in range(300)}
        assert seen <= allowed and len(seen) == 2, (params, seen)


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(2))
    prompt, output = [1, 5, 7], [7, 9, 30]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    from ninfer.engine.sampling import _apply_penalties
    ours = _apply_penalties(logits[0].clone(), row(SamplingParams(repetition_penalty=1.3), prompt=prompt, output=output))
    torch.testing.assert_close(ours, ref[0])


def test_presence_frequency_penalties() -> None:
    from ninfer.engine.sampling import _apply_penalties
    x = torch.zeros(10)
    out = _apply_penalties(x.clone(), row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                                          prompt=[3], output=[1, 1, 2]))
    expect = torch.zeros(10)
    expect[1] = -(0.5 + 2 * 0.25)
    expect[2] = -(0.5 + 0.25)
    torch.testing.assert_close(out, expect)  # prompt token 3 is not penalized


def test_nonfinite_rows_are_reported() -> None:
    logits = torch.randn(3, 20)
    logits[1, 4] = float("nan")
    logits[2, 0] = float("inf")
    res = sample(logits, [row(SamplingParams(temperature=0))] * 3)
    assert res.bad_rows == [1, 2] and res.token_ids[0] == int(logits[0].argmax())


# ---------------------------------------------------------------------------- detokenizer

def test_incremental_detokenizer_equals_full_decode(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = "def main():\n    print('héllo wörld 🦊')\n    return 0  <|im_end|> tail"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [1, 2, 3])
    pieces = []
    for t in ids:
        d.add_token(t)
        pieces.append(d.take_new_text(finished=False))
    pieces.append(d.take_new_text(finished=True))
    assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_truncates_and_holds_back(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    d = IncrementalDetokenizer(tok, [], stop=["fox jumps"])
    streamed, hit = "", None
    for t in ids:
        hit = d.add_token(t)
        streamed += d.take_new_text(finished=hit is not None)
        assert "fox" not in streamed or hit, "a partial stop string was streamed"
        if hit:
            break
    assert hit == "fox jumps" and d.text == streamed == "the quick brown "
    d2 = IncrementalDetokenizer(tok, [], stop=["fox jumps"], include_stop_str_in_output=True)
    for t in ids:
        if d2.add_token(t):
            break
    assert d2.text == "the quick brown fox jumps"


# ---------------------------------------------------------------------------- through the engine

def test_seed_reproducible_whatever_the_batch(llm: LLM) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([[10, 11, 12]], p, use_tqdm=False)[0].token_ids
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    mixed = llm.generate([[40, 41], [10, 11, 12], [5] * 70], [other, p, other], use_tqdm=False)[1].token_ids
    assert alone == mixed
    unseeded = [llm.generate([[10, 11, 12]], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0].token_ids
                for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_streamed_text_and_logprobs(llm: LLM) -> None:
    eng = llm.engine
    got: list[torch.Tensor] = []
    eng.logits_hook = lambda reqs, lg: got.append(lg[0].clone())
    try:
        eng.add_request("s", "hello world", SamplingParams(max_tokens=20, temperature=0.9, seed=3, logprobs=0,
                                                           ignore_eos=True))
        new_text, final = "", None
        while eng.has_unfinished_requests():
            for out in eng.step():
                new_text += out.new_text
                final = out
    finally:
        eng.logits_hook = None
    assert final.finished and final.finish_reason == "length" and len(final.token_ids) == 20
    assert new_text == final.text == llm.get_tokenizer().decode(final.token_ids, skip_special_tokens=True)
    expect = [float(torch.log_softmax(lg, -1)[t]) for lg, t in zip(got, final.token_ids)]
    assert final.logprobs == pytest.approx(expect, abs=1e-5) and all(lp <= 0 for lp in final.logprobs)
    assert final.outputs[0].cumulative_logprob == pytest.approx(sum(expect), abs=1e-4)


def _force(eng, token: int, at_step: int):
    state = {"n": 0}

    def hook(reqs: list[Request], logits: torch.Tensor) -> None:
        state["n"] += 1
        if state["n"] == at_step:
            logits[0, token] = 1e4
    eng.logits_hook = hook


def test_eos_stop_token_and_stop_string(llm: LLM) -> None:
    eng, tok = llm.engine, llm.get_tokenizer()
    eos = tok.eos_token_id
    try:
        _force(eng, eos, 4)
        out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) == 4
        assert "<|im_end|>" not in out.text and out.stop_reason is None
        _force(eng, eos, 4)
        out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 30
        _force(eng, 99, 3)
        out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[99]),
                           use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.stop_reason == 99 and len(out.token_ids) == 3
    finally:
        eng.logits_hook = None
    free = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    text = free.text
    assert len(text) > 12
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.index(stop)
    out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:cut]
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < 40


def test_nan_logits_finish_with_error(llm: LLM) -> None:
    eng = llm.engine
    eng.logits_hook = lambda reqs, lg: lg[0].fill_(math.nan) if reqs[0].num_output_tokens == 2 else None
    try:
        outs = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    finally:
        eng.logits_hook = None
    assert outs[0].finish_reason == "error" and "NaN" in outs[0].error and len(outs[0].token_ids) == 2
    assert eng.stats().num_free_pages == eng.stats().num_total_pages


def test_too_long_request_is_rejected_with_numbers(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt \(500 tokens\) \+ max_tokens \(20\) = 520 exceeds max_context=512"):
        llm.engine.add_request("long", [5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request("oov", [10**6], SamplingParams())
    # max_tokens=None fills the context
    out = llm.generate([[5] * 500], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert not llm.engine.has_unfinished_requests()


def test_nonfinite_kv_fails_the_batch_not_the_engine(tiny_checkpoint) -> None:
    bad = LLM(str(tiny_checkpoint()), kv_dtype="rk4v4-e8", device="cpu", max_context=512, kv_capacity=1024)
    eng = bad.engine
    w = eng.model.model.layers[0].self_attn.qkv_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w.fill_(math.nan)
    outs = bad.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "error"] and "non-finite" in outs[0].error
    assert eng.stats().num_free_pages == eng.stats().num_total_pages
    with torch.no_grad():
        w.copy_(saved)
    out = bad.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
