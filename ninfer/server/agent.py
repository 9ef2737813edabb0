"""The chat features of agents and thinking models, between the request and the engine:

* `plan_chat` validates `tools`, `tool_choice` and `response_format`, picks the reasoning and
  tool-call parsers (flags, or auto from the chat template) and gives the chat template its
  extra arguments (`tools=`, the request's `chat_template_kwargs`);
* `ChatPlan.constrain` turns tool_choice required / named and response_format into a grammar
  (a StructuredSpec), compiled off the event loop before the request reaches the engine;
* `ChatPlan.message` / `ChatPlan.streamer` split each output into reasoning_content, content and
  tool_calls (finish_reason "tool_calls" when the model called a tool).

A plain chat request (no tools, no response_format, no reasoning parser) passes through: no
grammar, and its text goes to `content` unchanged."""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ninfer.server.protocol import (ChatCompletionRequest, ChatResponseMessage, DeltaFunctionCall, DeltaMessage,
                                    DeltaToolCall, FunctionCall, NamedToolChoice, ToolCall)
from ninfer.server.reasoning import ReasoningParser, get_reasoning_parser, prompt_opens_reasoning
from ninfer.server.serving import APIError
from ninfer.server.tool_parsers import ParsedCall, ToolParser, get_tool_parser


def PlanError(message: str, param: str) -> APIError:
    """A request this server cannot serve as asked: 400, naming the field."""
    return APIError(400, message, param=param)


@dataclass
class ChatPlan:
    template_kwargs: dict[str, Any]
    reasoning: ReasoningParser | None = None
    tool_parser: ToolParser | None = None          # set only when the model may call tools
    tools: list[dict] = field(default_factory=list)
    tool_choice: Any = "none"                      # "auto" | "required" | {"type": "function", ...} | "none"
    parallel: bool = True
    schema: dict | None = None                     # response_format json_schema; {} = any JSON object
    prompt_open: bool = False                      # the prompt ends inside a <think> block

    # -------------------------------------------------------------- the grammar

    def read_prompt(self, prompt_tail: str) -> str:
        """Note whether the prompt (its last tokens' text) opened a reasoning block, and return
        xgrammar's reasoning mode for a constrained output: "enabled" (inside a block the prompt
        opened), "auto" (the model may think first), "disabled" (no parser, or thinking off)."""
        if self.reasoning is None:
            return "disabled"
        self.prompt_open = prompt_opens_reasoning(prompt_tail, self.reasoning)
        if self.prompt_open:
            return "enabled"
        # A template with thinking off closes an empty block in the prompt itself.
        return "disabled" if prompt_tail.rstrip().endswith(self.reasoning.end) else "auto"

    def spec(self, prompt_tail: str) -> Any:
        """The StructuredSpec this request's output must follow, or None."""
        from ninfer.engine.structured import StructuredSpec

        mode = self.read_prompt(prompt_tail)
        if self.tool_parser is not None and self.tool_choice != "auto":
            return StructuredSpec("structural_tag", self.tool_parser.structural_tag(
                self.tools, self.tool_choice, mode, self.parallel))
        if self.schema is None:
            return None
        schema = self.schema or {"type": "object"}
        if mode == "disabled":
            return StructuredSpec.from_json("json_schema", schema)
        return StructuredSpec("structural_tag", _think_then_json(self.reasoning, mode, schema))

    async def constrain(self, serving: Any, params: Any, prompt_ids: list[int]) -> Any:
        """params with the request's grammar, compiled (cached) off the event loop. Raises a 400
        for a schema the compiler rejects."""
        if self.reasoning is None and self.schema is None and self.tool_parser is None:
            return params
        tail = await serving.on_tokenizer(_decode_tail, serving, prompt_ids[-32:])
        if self.schema is None and (self.tool_parser is None or self.tool_choice == "auto"):
            self.read_prompt(tail)        # only where the reasoning starts matters
            return params
        if not have_xgrammar():
            raise PlanError("this server cannot constrain output: the xgrammar package is not installed "
                            "(pip install 'ninfer[structured]')", "response_format" if self.schema is not None else "tool_choice")
        spec = self.spec(tail)
        grammars = getattr(serving.engine.engine, "grammars", None)   # GrammarCache: thread-safe
        if grammars is None:
            raise PlanError("this engine has no structured-output support", "response_format")
        from ninfer.engine.structured import StructuredError
        try:
            await asyncio.wrap_future(grammars.submit(spec))
        except StructuredError as e:
            if self.tool_parser is not None:
                raise PlanError(f"tools: a function's parameters are not a usable JSON schema: {e.reason}", "tools") from e
            raise PlanError(f"response_format: the schema is not a usable JSON schema: {e.reason}",
                            "response_format") from e
        return dataclasses.replace(params, structured=spec)

    # -------------------------------------------------------------- the output

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, self.prompt_open)
        calls: list[ParsedCall] = []
        if self.tool_parser is not None and content:
            content, calls = self.tool_parser.parse(content, self.tools)
        tool_calls = [ToolCall(id=_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        return (ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls),
                _finish(finish_reason, bool(calls)))

    def streamer(self) -> "ChatStreamer":
        return ChatStreamer(self)


class ChatStreamer:
    """One streamed choice: text deltas in, DeltaMessages out."""

    def __init__(self, plan: ChatPlan) -> None:
        self.splitter = plan.reasoning.splitter(plan.prompt_open) if plan.reasoning is not None else None
        self.tools = plan.tool_parser.stream(plan.tools) if plan.tool_parser is not None else None
        self.num_calls = 0

    def feed(self, text: str) -> list[DeltaMessage]:
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        return self._deltas(reasoning, content, final=False)

    def finish(self, finish_reason: str | None) -> tuple[list[DeltaMessage], str | None]:
        reasoning, content = self.splitter.flush() if self.splitter is not None else ("", "")
        deltas = self._deltas(reasoning, content, final=True)
        return deltas, _finish(finish_reason, self.num_calls > 0)

    def _deltas(self, reasoning: str, content: str, *, final: bool) -> list[DeltaMessage]:
        calls: list[ParsedCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content) if content else ("", [])
            if final:
                more, tail_calls = self.tools.flush()
                content, calls = content + more, calls + tail_calls
        out = []
        if reasoning:
            out.append(DeltaMessage(reasoning_content=reasoning))
        if content:
            out.append(DeltaMessage(content=content))
        for c in calls:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=self.num_calls, id=_call_id(), type="function",
                function=DeltaFunctionCall(name=c.name, arguments=c.arguments))]))
            self.num_calls += 1
        return out


def plan_for(serving: Any, req: ChatCompletionRequest) -> ChatPlan:
    """plan_chat with the server's flags and the model's chat template."""
    return plan_chat(req, getattr(serving.engine.tokenizer, "chat_template", None),
                     reasoning_parser=serving.config.reasoning_parser, tool_call_parser=serving.config.tool_call_parser)


def plan_chat(req: ChatCompletionRequest, chat_template: str | None, *, reasoning_parser: str | None,
              tool_call_parser: str | None) -> ChatPlan:
    """Validate the agent fields of a chat request (a 400 for a mistake) and plan them."""
    kwargs = dict(req.chat_template_kwargs or {})
    plan = ChatPlan(template_kwargs=kwargs, reasoning=get_reasoning_parser(reasoning_parser, chat_template),
                    parallel=req.parallel_tool_calls)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise PlanError(f"tool names must be unique, got {names}", "tools")
    if choice is not None and not tools and choice != "none":
        raise PlanError("tool_choice needs `tools`", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise PlanError(f"tool_choice names the function {choice.function.name!r}, which is not in `tools` "
                        f"({', '.join(names)})", "tool_choice")
    choice = choice or ("auto" if tools else "none")
    if tools and choice != "none":
        plan.tool_parser = get_tool_parser(tool_call_parser, chat_template)
        if plan.tool_parser is None:
            raise PlanError("this server has no tool-call parser for the model's chat template; start it with "
                            "--tool-call-parser hermes|qwen3_coder|llama3_json", "tools")
        kwargs["tools"] = tools
        plan.tools = tools
        plan.tool_choice = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if plan.tool_parser is not None and plan.tool_choice != "auto":
            raise PlanError("response_format cannot be combined with tool_choice required or a named "
                            "function (both constrain the whole output)", "response_format")
        if rf.type == "json_object":
            plan.schema = {}
        else:
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            if not isinstance(schema, dict):
                raise PlanError("response_format json_schema needs json_schema.schema (a JSON schema object)",
                                "response_format")
            plan.schema = schema
    return plan


def template_message(d: dict[str, Any]) -> dict[str, Any]:
    """A message dict as chat templates expect it: tool-call arguments as objects (templates
    write them with `tojson`), no reasoning_content."""
    d.pop("reasoning_content", None)
    for call in d.get("tool_calls") or []:
        fn = call.get("function", {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"] or "{}")
            except json.JSONDecodeError as e:
                raise PlanError(f"tool call {call.get('id')!r}: arguments are not valid JSON ({e})", "messages") from e
    return d


def _think_then_json(reasoning: ReasoningParser, mode: str, schema: dict) -> str:
    """A structural tag: an optional (or prompt-opened) reasoning block, then the JSON."""
    from xgrammar import structural_tag as st

    think: Any = st.TagFormat(begin="" if mode == "enabled" else reasoning.start,
                              content=st.AnyTextFormat(excludes=[reasoning.start, reasoning.end]), end=reasoning.end)
    think = st.SequenceFormat(elements=[think, st.ConstStringFormat(value="\n\n")])
    if mode == "auto":
        think = st.OptionalFormat(content=think)
    body = st.SequenceFormat(elements=[think, st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=1)])
    return st.StructuralTag(format=body).model_dump_json()


def _decode_tail(serving: Any, ids: list[int]) -> str:
    """On a tokenizer thread: that thread's tokenizer where the server keeps one per thread."""
    tok = getattr(serving, "tokenizer", None) or serving.engine.tokenizer
    return tok.decode(ids, skip_special_tokens=False)


def have_xgrammar() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
