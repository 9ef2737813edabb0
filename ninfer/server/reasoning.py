"""Reasoning parsers: the `<think>...</think>` block of thinking models (Qwen3, Qwen3.5, QwQ,
DeepSeek-R1) split out of the generated text into `reasoning_content`, whole or as a stream.

Where the block starts depends on the chat template: Qwen3 lets the model write `<think>` itself,
Qwen3.5 and DeepSeek-R1 put it at the end of the prompt. So the splitter is told whether the
prompt already opened a block (`prompt_opens_reasoning`); otherwise a block counts only when the
output starts with the opening tag. An output cut off inside the block is all reasoning."""
from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = THINK_START
    end: str = THINK_END

    def splitter(self, prompt_open: bool) -> "ReasoningSplitter":
        return ReasoningSplitter(self, prompt_open)

    def split(self, text: str, prompt_open: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where a part is absent."""
        sp = self.splitter(prompt_open)
        r1, c1 = sp.feed(text)
        r2, c2 = sp.flush()
        return (r1 + r2) if sp.saw_reasoning else None, (c1 + c2) or None


# Qwen3's and DeepSeek-R1's formats are the same tags; both names exist because users know them.
REASONING_PARSERS = {name: ReasoningParser(name) for name in ("qwen3", "deepseek_r1")}


def get_reasoning_parser(name: str | None, chat_template: str | None) -> ReasoningParser | None:
    """`name`: a parser name, "none" (off) or "auto"/None (on when the template knows `</think>`)."""
    if name in (None, "auto"):
        return REASONING_PARSERS["qwen3"] if isinstance(chat_template, str) and THINK_END in chat_template else None
    if name == "none":
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (choose from {', '.join(['auto', 'none', *REASONING_PARSERS])})")
    return REASONING_PARSERS[name]


def prompt_opens_reasoning(prompt_tail: str, parser: ReasoningParser) -> bool:
    """Does the rendered prompt end inside an open reasoning block (the template wrote `<think>`)?"""
    start = prompt_tail.rfind(parser.start)
    return start >= 0 and prompt_tail.find(parser.end, start) < 0


class ReasoningSplitter:
    """Incremental split: feed() each new piece of text, get back (reasoning delta, content delta).
    A tag split across pieces is held back until it is whole (or proves not to be the tag)."""

    def __init__(self, parser: ReasoningParser, prompt_open: bool) -> None:
        self.p = parser
        # "start": nothing seen yet (a block may open); "think": inside; "content": after / none
        self.state = "think" if prompt_open else "start"
        self.saw_reasoning = prompt_open
        self._held = ""
        self._strip_newlines = False   # the template's "\n\n" after </think> is not content

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        reasoning, content = "", ""
        while buf:
            if self.state == "start":
                lead = buf.lstrip()
                if lead.startswith(self.p.start):
                    self.state, self.saw_reasoning = "think", True
                    buf = lead[len(self.p.start):]
                elif self.p.start.startswith(lead):   # still could be the tag (or only blanks)
                    self._held = buf
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "think":
                i = buf.find(self.p.end)
                if i >= 0:
                    reasoning += buf[:i]
                    buf = buf[i + len(self.p.end):]
                    self.state, self._strip_newlines = "content", True
                else:
                    keep = partial_suffix(buf, self.p.end)
                    reasoning += buf[:len(buf) - keep]
                    self._held = buf[len(buf) - keep:]
                    return reasoning, content
            else:
                if self._strip_newlines:
                    buf = buf.lstrip("\n")
                    if not buf:
                        break
                    self._strip_newlines = False
                content += buf
                buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The end of the output: whatever is held back is what it is."""
        held, self._held = self._held, ""
        return (held, "") if self.state == "think" else ("", held)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
