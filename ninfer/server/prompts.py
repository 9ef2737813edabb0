"""Prompt text -> token ids for OpenAIServing, on its tokenizer threads: chat templates, plain
prompts, detokenizing, and the length pre-check that refuses text before any tokenizing."""
from __future__ import annotations

import asyncio
import copy
from typing import Any, Callable

from ninfer.server.errors import APIError
from ninfer.server.protocol import ChatMessage

# Slack on the bytes -> tokens bound, for normalizers that shrink text (NFC merges a letter and its
# combining accent): the pre-check must never refuse a prompt that would have fit.
_TEXT_BOUND_SLACK = 2


class PromptTokenizing:
    """The tokenizer side of OpenAIServing, which sets ``engine``, ``config``, ``_tok_pool`` (the
    tokenizer threads) and ``_tok_local`` (a threading.local holding each thread's tokenizer)."""

    async def on_tokenizer(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, lambda: fn(*args, **kw))

    @property
    def tokenizer(self) -> Any:
        """The calling tokenizer thread's own copy of the tokenizer."""
        tok = getattr(self._tok_local, "tok", None)
        if tok is None:
            tok = self._tok_local.tok = copy.deepcopy(self.engine.tokenizer)
        return tok

    def check_text_fits(self, texts: list[str], param: str) -> None:
        """Refuse text that is longer than the context whatever it tokenizes to, without tokenizing
        it (a character is at least one UTF-8 byte; see async_engine.max_token_bytes)."""
        per_token = self.engine.max_token_bytes * _TEXT_BOUND_SLACK
        if not per_token:
            return
        chars = sum(len(t) for t in texts)
        least = chars // per_token
        if least >= self.engine.max_context:
            raise APIError(400, f"This model's maximum context length is {self.engine.max_context} tokens. However, "
                                f"the {param} has {chars} characters, at least {least} tokens. Please reduce the "
                                f"length of the {param}.", param=param)

    def chat_prompt_ids(self, messages: list[ChatMessage], *, add_generation_prompt: bool,
                        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                        ) -> list[int]:
        """Runs on the tokenizer thread."""
        tok = self.tokenizer
        msgs = [_message_dict(m) for m in messages]
        kwargs: dict[str, Any] = {}
        template = getattr(tok, "chat_template", None)
        if self.config.no_thinking and isinstance(template, str) and "enable_thinking" in template:
            kwargs["enable_thinking"] = False
        kwargs.update(template_kwargs or {})
        if not template:
            # No template shipped: a plain role-prefixed transcript, so base models still serve.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
            if add_generation_prompt:
                text += "assistant:"
        else:
            try:
                text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message, **kwargs)
            except Exception as e:  # jinja errors (e.g. a role the template rejects) are the client's
                raise APIError(400, f"chat template failed: {e}", param="messages") from e
        return list(tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Runs on the tokenizer thread."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return list(prompt)    # ids: the engine checks them against the model's vocabulary

    def detokenize(self, ids: list[int]) -> str:
        """Runs on the tokenizer thread."""
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids outside the tokenizer's range [0, {vocab}): {bad[:5]}", param="tokens")
        return self.tokenizer.decode(ids)


def message_texts(messages: list[ChatMessage]) -> list[str]:
    """The text a chat template will carry (for the length pre-check)."""
    out = []
    for m in messages:
        if isinstance(m.content, str):
            out.append(m.content)
        elif m.content:
            out += [p.text for p in m.content if p.text]
    return out


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    from ninfer.server.agent import template_message
    d = template_message(m.model_dump(exclude_none=True))
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content part of type {part.type!r} is not supported (text only)",
                               param="messages")
            texts.append(part.text)
        d["content"] = "".join(texts)
    elif m.content is None:
        d["content"] = ""
    return d
