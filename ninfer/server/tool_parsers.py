"""Tool-call parsers: the model's own tool-call syntax turned into OpenAI `tool_calls`, whole or as
a stream, and the grammar that makes a model write that syntax (tool_choice required / named).

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them between
  text (Hermes, Qwen2.5, Qwen3, QwQ).
* `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`
  (Qwen3.5, Qwen3.6, Qwen3-Coder); a value is text when its schema says string, else JSON.
* `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` (or several joined by
  `;`), optionally after `<|python_tag|>` (Llama 3.1/3.2/3.3 JSON tool calling).

The grammars come from xgrammar's model formats ("qwen_3", "qwen_3_5" and "llama"), which write
exactly what these parsers read, so a constrained call always parses."""
from __future__ import annotations

from abc import ABC, abstractmethod

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from ninfer.server.reasoning import partial_suffix


@dataclass
class ParsedCall:
    name: str
    arguments: str                      # JSON text


def _call_from_json(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):           # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallStream(ABC):
    """Incremental parse: feed() new text, get (content delta, calls completed by it); flush() at
    the end. Trailing whitespace is held until real text follows, so the blanks around calls do
    not become content."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ParsedCall]]: ...

    @abstractmethod
    def flush(self) -> tuple[str, list[ParsedCall]]: ...


class _TaggedStream(ToolCallStream):
    def __init__(self, start: str, end: str, parse: Callable[[str], ParsedCall | None]) -> None:
        self.start, self.end, self._parse = start, end, parse
        self._buf = ""
        self._inside = False
        self._blank = ""                # trailing whitespace of the content so far, not yet sent
        self._pre = ""                  # the whitespace before the open tag (back if it is no call)

    def _content(self, text: str) -> str:
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        return body

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buf += text
        content, calls = "", []
        while self._buf:
            if not self._inside:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = partial_suffix(self._buf, self.start)
                    content += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content += self._content(self._buf[:i])
                self._pre, self._blank = self._blank, ""
                self._buf, self._inside = self._buf[i + len(self.start):], True
            else:
                j = self._buf.find(self.end)
                if j < 0:
                    break
                body, self._buf, self._inside = self._buf[:j], self._buf[j + len(self.end):], False
                call = self._parse(body)
                if call is None:        # not a call after all: the text stays the model's words
                    content += self._content(self._pre + self.start + body + self.end)
                else:
                    calls.append(call)
        return content, calls

    def flush(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        if not self._inside:
            return self._content(buf), []
        self._inside = False
        call = self._parse(buf)         # an unterminated last call (cut by a stop string) may be whole
        return ("", [call]) if call is not None else (self._content(self._pre + self.start + buf), [])


class _JsonStream(ToolCallStream):
    """Llama 3: the output is tool calls only if it starts with `{` (or the python tag)."""
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"            # start | json (buffer to the end) | text

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._mode == "text":
            return text, []
        self._buf += text
        if self._mode == "start":
            lead = self._buf.lstrip()
            if lead.startswith("{") or lead.startswith(self.PYTHON_TAG):
                self._mode = "json"
            elif lead and not self.PYTHON_TAG.startswith(lead):
                self._mode, out, self._buf = "text", self._buf, ""
                return out, []
        return "", []

    def flush(self) -> tuple[str, list[ParsedCall]]:
        buf, self._buf = self._buf, ""
        if self._mode != "json":
            return buf, []
        calls = _json_calls(buf.strip().removeprefix(self.PYTHON_TAG))
        return ("", calls) if calls else (buf, [])


def _json_body(body: str) -> ParsedCall | None:
    try:
        return _call_from_json(json.loads(body), ("arguments", "parameters"))
    except json.JSONDecodeError:
        return None


_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _xml_body(body: str, tools: list[dict]) -> ParsedCall | None:
    """Qwen's XML call; each value is JSON-decoded unless its parameter is a string (or not JSON)."""
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    props = next((((t.get("function") or {}).get("parameters") or {}).get("properties") or {}
                  for t in tools if (t.get("function") or {}).get("name") == name), {})
    args: dict[str, Any] = {}
    for key, raw in _PARAMETER.findall(inner):
        value: Any = raw.strip()
        if (props.get(key) or {}).get("type") != "string":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        args[key.strip()] = value
    if _PARAMETER.sub("", inner).strip():   # stray text between parameters: not a call
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _json_calls(text: str) -> list[ParsedCall]:
    """`{...}; {...}` -> calls; [] when any piece is not a call."""
    dec, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return calls
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        call = _call_from_json(obj, ("parameters", "arguments"))
        if call is None:
            return []
        calls.append(call)


@dataclass(frozen=True)
class ToolParser:
    name: str
    xgrammar_format: str                # get_model_structural_tag's model name
    markers: tuple[str, ...]            # chat-template text that identifies the format
    unless: tuple[str, ...] = ()        # ... unless the template has this (a more specific format)

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        """`tools`: the request's tools (the XML format reads their parameter types)."""
        if self.name == "hermes":
            return _TaggedStream("<tool_call>", "</tool_call>", _json_body)
        if self.name == "qwen3_coder":
            return _TaggedStream("<tool_call>", "</tool_call>", lambda body: _xml_body(body, tools or []))
        return _JsonStream()

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a whole output; content None when only calls (and blanks) remain."""
        s = self.stream(tools)
        c1, k1 = s.feed(text)
        c2, k2 = s.flush()
        content = (c1 + c2).strip()
        return content or None, k1 + k2

    def structural_tag(self, tools: list[dict], tool_choice: Any, reasoning: str, parallel: bool) -> str:
        """The xgrammar structural tag (JSON) that makes the model call tools in this format:
        tool_choice "required" (at least one call) or {"type": "function", ...} (that one)."""
        import xgrammar as xgr

        tag = xgr.get_model_structural_tag(self.xgrammar_format, tools=tools, tool_choice=tool_choice,
                                           reasoning=reasoning, parallel_tool_calls=parallel,
                                           max_whitespace_cnt=1)
        return tag.model_dump_json()


TOOL_PARSERS = {
    "hermes": ToolParser("hermes", "qwen_3", ("<tool_call>",), unless=("<function=",)),
    "qwen3_coder": ToolParser("qwen3_coder", "qwen_3_5", ("<function=",)),
    "llama3_json": ToolParser("llama3_json", "llama", ("<|python_tag|>", '"parameters"')),
}


def get_tool_parser(name: str | None, chat_template: str | None) -> ToolParser | None:
    """`name`: a parser, "none", or "auto"/None: the one whose markers the chat template contains
    (None when no parser or more than one matches)."""
    if name in (None, "auto"):
        if not isinstance(chat_template, str) or "tools" not in chat_template:
            return None
        hits = [p for p in TOOL_PARSERS.values() if any(m in chat_template for m in p.markers)
                and not any(u in chat_template for u in p.unless)]
        return hits[0] if len(hits) == 1 else None
    if name == "none":
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (choose from {', '.join(['auto', 'none', *TOOL_PARSERS])})")
    return TOOL_PARSERS[name]
