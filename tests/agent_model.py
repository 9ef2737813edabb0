"""A tiny random-weight Qwen3 with a Qwen3-style chat template that knows tools and thinking, for
the agent API tests. The template (written here, shaped like Qwen3's) renders `tools` into the
system turn, tool calls as `<tool_call>{json}</tool_call>`, tool results as `<tool_response>`,
and `enable_thinking=False` as an empty think block at the start of the assistant turn."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

AGENT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""


def make_agent_model(src: Path, dst: Path) -> Path:
    """Copy the tiny checkpoint `src` (its vocab must leave room for 4 more tokens) to `dst` and give
    it the agent tokens (plain added tokens: they decode into the text, as Qwen3's do) and template."""
    from transformers import AddedToken, AutoTokenizer

    if dst.exists():
        return dst
    shutil.copytree(src, dst)
    tok: Any = AutoTokenizer.from_pretrained(dst)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_TOKENS])
    tok.chat_template = AGENT_TEMPLATE
    tok.save_pretrained(dst)
    return dst
