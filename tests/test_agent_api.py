"""The OpenAI API of agents and thinking models, end to end through ninfer-serve (real uvicorn,
real engine, official `openai` client) on a tiny random-weight Qwen3 whose chat template knows
tools and thinking (tests/agent_model.py).

Random weights cannot choose to call a tool, so two kinds of evidence: grammar-constrained requests
(tool_choice required / named, response_format), where the grammar alone must make the output
valid - checked by parsing it and validating it with pydantic against the schema - and a scripted
logits hook that forces the model to write a given text, which must come back split into
reasoning_content, content and tool_calls exactly as written."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.agent_model import make_agent_model
from tests.test_server import LiveServer, assert_envelope, make_server

MODEL = "tiny"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


class Weather(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


class Answer(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool
    note: str = Field(pattern=r"^[a-z ]{1,12}$")   # (xgrammar 0.2.9 lets control characters into maxLength strings)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": Weather.model_json_schema()}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                           "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "Will it be sunny in Paris?"}]


@pytest.fixture(scope="module")
def srv(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    model = make_agent_model(tiny_checkpoint(vocab=392), tmp_path_factory.mktemp("agent") / "model")
    s = make_server(model, engine_kw={"max_context": 2048, "kv_capacity": 16384})
    s.wait_health()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


class scripted:
    """While active, every request's output is forced to `text` then EOS (the engine's logits hook)."""

    def __init__(self, srv: LiveServer, text: str) -> None:
        self.engine = srv.engine.engine
        tok = self.engine.tokenizer
        self.ids = list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]

    def hook(self, reqs: list[Any], logits: Any) -> None:
        for j, r in enumerate(reqs):
            logits[j].fill_(-1e4)
            logits[j, self.ids[min(r.num_output_tokens, len(self.ids) - 1)]] = 1e4

    def __enter__(self) -> "scripted":
        self.engine.logits_hook = self.hook
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.logits_hook = None


def collect_stream(stream: Any) -> dict[str, Any]:
    """Reassemble a streamed choice the way agent frameworks do."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        out["content"] += d.content or ""
        out["reasoning"] += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        out["finish"] = ch.finish_reason or out["finish"]
    out["calls"] = [out["calls"][k] for k in sorted(out["calls"])]
    return out


# ------------------------------------------------------------------------------------ the agent loop


@pytest.mark.parametrize("seed", [0, 1])
def test_agent_loop_tools_stream_results_and_json_answer(client: openai.OpenAI, srv: LiveServer, seed: int) -> None:
    # 1. the model must call a tool (streamed); the grammar makes the call valid for its schema
    got = collect_stream(client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True,
        max_tokens=300, temperature=1.0, seed=seed, extra_body=NO_THINK))
    assert got["finish"] == "tool_calls" and len(got["calls"]) == 1, got
    call = got["calls"][0]
    assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
    args = json.loads(call["arguments"])
    if call["name"] == "get_weather":
        Weather.model_validate(args)
    # 2. the tool's result goes back through the template; 3. the final answer follows a schema
    messages = USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call["id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"forecast": "sunny", "high_c": 24}'}]
    ids = httpx.post(f"{srv.url}/tokenize", json={"model": MODEL, "messages": messages,
                                                  "chat_template_kwargs": {"tools": TOOLS}}).json()["tokens"]
    prompt = httpx.post(f"{srv.url}/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert '<tool_response>\n{"forecast": "sunny", "high_c": 24}\n</tool_response>' in prompt
    assert f'{{"name": "{call["name"]}", "arguments": {json.dumps(args)}}}' in prompt
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, seed=seed, extra_body=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": Answer.model_json_schema()}})
    ch = final.choices[0]
    assert ch.finish_reason == "stop" and not ch.message.tool_calls
    Answer.model_validate_json(ch.message.content)


def test_named_tool_choice_and_parallel_calls(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (3, 4):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=named, seed=seed,
                                           max_tokens=300, extra_body=NO_THINK)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
        Weather.model_validate_json(ch.message.tool_calls[0].function.arguments)
    # required with parallel calls allowed: every call parses and validates, ids are distinct
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", seed=5,
                                       max_tokens=300, extra_body=NO_THINK)
    calls = r.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.function.name in ("get_weather", "get_time")
        if c.function.name == "get_weather":
            Weather.model_validate_json(c.function.arguments)


# ------------------------------------------------------------------------------------ parsing the model's text

CALL_TEXT = ('<think>The user wants weather.</think>\n\nLet me look.\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n<tool_call>\n'
             '{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_tool_calls_and_reasoning_parsed_from_model_text(client: openai.OpenAI, srv: LiveServer) -> None:
    with scripted(srv, CALL_TEXT):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200)
        streamed = collect_stream(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                                 max_tokens=200, stream=True))
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.reasoning_content == "The user wants weather." and m.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    assert streamed["finish"] == "tool_calls"
    assert (streamed["reasoning"], streamed["content"].strip()) == ("The user wants weather.", "Let me look.")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    # tool_choice none: tools are not offered and the same text stays text
    with scripted(srv, CALL_TEXT):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "<tool_call>" in r.choices[0].message.content


def test_thinking_per_request_and_reasoning_parser_off(client: openai.OpenAI, srv: LiveServer) -> None:
    def prompt(**extra: Any) -> str:
        ids = httpx.post(f"{srv.url}/tokenize", json={"model": MODEL, "messages": USER, **extra}).json()["tokens"]
        return httpx.post(f"{srv.url}/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]

    assert prompt().endswith("<|im_start|>assistant\n")
    assert prompt(**NO_THINK).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    text = "<think>\nTwo and two.\n</think>\n\nFour."
    with scripted(srv, text):
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100)
        s = collect_stream(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, stream=True))
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("\nTwo and two.\n", "Four.")
    assert (s["reasoning"], s["content"]) == ("\nTwo and two.\n", "Four.")
    with scripted(srv, "Four."):   # thinking off: the answer is all content
        off = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, extra_body=NO_THINK)
    assert (off.choices[0].message.content, off.choices[0].message.reasoning_content) == ("Four.", None)
    config = srv.app.state.serving.config
    config.reasoning_parser = "none"
    try:
        with scripted(srv, text):
            raw = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100)
    finally:
        config.reasoning_parser = "auto"
    assert raw.choices[0].message.content == text and raw.choices[0].message.reasoning_content is None


def test_json_object_and_schema_always_valid(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, n=3, seed=7, max_tokens=300, extra_body=NO_THINK,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "answer", "schema": Answer.model_json_schema()}})
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        Answer.model_validate_json(ch.message.content)
    s = collect_stream(client.chat.completions.create(
        model=MODEL, messages=USER, seed=8, max_tokens=300, stream=True, extra_body=NO_THINK,
        response_format={"type": "json_object"}))
    assert s["finish"] == "stop" and isinstance(json.loads(s["content"]), dict)


# ------------------------------------------------------------------------------------ refusals


def test_bad_schemas_and_unknown_tools_are_400(srv: LiveServer) -> None:
    def chat(**body: Any) -> httpx.Response:
        return httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": USER, "max_tokens": 5, **body})

    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    cases = [
        (dict(response_format=bad_schema), "response_format", "objectx"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format", "schema"),
        (dict(response_format={"type": "yaml"}), "response_format.type", None),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
        (dict(tool_choice="required"), "tool_choice", "tools"),
        (dict(tools=TOOLS + TOOLS[:1]), "tools", "unique"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
              tool_choice="required"), "tools", "objectx"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format", None),
        (dict(messages=USER + [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}]),
         "messages", "not valid JSON"),
    ]
    for body, param, words in cases:
        err = assert_envelope(chat(**body), 400)
        assert err["param"] == param, (body, err)
        assert words is None or words in err["message"], (body, err)
    config = srv.app.state.serving.config
    config.tool_call_parser = "none"
    try:
        err = assert_envelope(chat(tools=TOOLS), 400)
        assert "--tool-call-parser" in err["message"]
    finally:
        config.tool_call_parser = "auto"
    import ninfer.server.agent as agent
    real = agent.have_xgrammar
    agent.have_xgrammar = lambda: False
    try:
        err = assert_envelope(chat(response_format={"type": "json_object"}), 400)
        assert "xgrammar" in err["message"] and err["param"] == "response_format"
        assert chat(tools=TOOLS).status_code == 200          # tool_choice auto needs no grammar
    finally:
        agent.have_xgrammar = real
    assert chat().status_code == 200   # still serving
    srv.wait_idle()


# ------------------------------------------------------------------------------------ parsers, piece by piece

PARSE_CASES = [
    # (tool parser, prompt opened a think block, text, reasoning, content, [(name, args)])
    ("hermes", False, CALL_TEXT, "The user wants weather.", "Let me look.",
     [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]),
    ("hermes", True, 'thinking </thi still</think>\n\nno call <tool_call>not json</tool_call>', "thinking </thi still",
     "no call <tool_call>not json</tool_call>", []),
    ("hermes", False, 'A <tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}', None, "A", [("f", {"x": 1})]),
    ("hermes", False, "<think>cut off in the middle", "cut off in the middle", None, []),
    ("qwen3_coder", False, 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n'
     '<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n'
     '</tool_call>', None, "Checking.", [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]),
    ("qwen3_coder", False, '<tool_call>\n<function=note>\n<parameter=text>\n42\n</parameter>\n</function>\n</tool_call>',
     None, None, [("note", {"text": "42"})]),    # a string parameter stays text even when it looks like JSON
    ("llama3_json", False, '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}',
     None, None, [("f", {"a": [1, 2]}), ("g", {})]),
    ("llama3_json", False, 'Sure: {"name": "f", "parameters": {}}', None, 'Sure: {"name": "f", "parameters": {}}', []),
    ("llama3_json", False, '{"not": "a call"}', None, '{"not": "a call"}', []),
]


@pytest.mark.parametrize("case", range(len(PARSE_CASES)))
def test_streamed_split_equals_whole_split(case: int) -> None:
    import random

    from ninfer.server.agent import ChatPlan
    from ninfer.server.reasoning import REASONING_PARSERS
    from ninfer.server.tool_parsers import TOOL_PARSERS

    parser, prompt_open, text, reasoning, content, calls = PARSE_CASES[case]
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}}
    plan = ChatPlan(template_kwargs={}, reasoning=REASONING_PARSERS["qwen3"], tool_parser=TOOL_PARSERS[parser],
                    tool_choice="auto", prompt_open=prompt_open, tools=TOOLS + [note])
    msg, finish = plan.message(text, "stop")
    assert (msg.reasoning_content, msg.content) == (reasoning, content)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == calls
    assert finish == ("tool_calls" if calls else "stop")
    for seed in range(30):   # the same result however the text is cut into deltas
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        st = plan.streamer()
        deltas = [d for a, b in zip([0] + cuts, cuts + [len(text)]) for d in st.feed(text[a:b])]
        tail, fin = st.finish("stop")
        deltas += tail
        r = "".join(d.reasoning_content or "" for d in deltas)
        c = "".join(d.content or "" for d in deltas)
        got = [(tc.function.name, json.loads(tc.function.arguments)) for d in deltas for tc in d.tool_calls or []]
        assert (r or None, c.strip() or None, got, fin) == (reasoning, content, calls, finish), (seed, deltas)
        assert all(sum(x is not None for x in (d.reasoning_content, d.content, d.tool_calls)) == 1 for d in deltas)


def test_parsers_picked_from_the_chat_template() -> None:
    from tests.agent_model import AGENT_TEMPLATE

    from ninfer.server.reasoning import get_reasoning_parser
    from ninfer.server.tool_parsers import get_tool_parser

    qwen35 = "{% if tools %}<tools>...</tools> <tool_call>\n<function=example>{% endif %}</think>"
    llama = '{% if tools %}Respond with {"name": function name, "parameters": dict}<|python_tag|>{% endif %}'
    assert get_tool_parser("auto", AGENT_TEMPLATE).name == "hermes"
    assert get_tool_parser("auto", qwen35).name == "qwen3_coder"
    assert get_tool_parser("auto", llama).name == "llama3_json"
    assert get_tool_parser("auto", "{{ messages }}") is None
    assert get_tool_parser("auto", llama + "<tool_call>") is None          # two formats fit: no guess
    assert get_tool_parser("llama3_json", AGENT_TEMPLATE).name == "llama3_json"
    assert get_tool_parser("none", AGENT_TEMPLATE) is None
    assert get_reasoning_parser("auto", qwen35).name == "qwen3"
    assert get_reasoning_parser("auto", llama) is None and get_reasoning_parser("none", qwen35) is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("mistral", None)
