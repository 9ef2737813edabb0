"""The generation endpoints: POST /v1/chat/completions and POST /v1/completions, both streaming
(SSE) and not. Each choice (`n` samples, times each prompt of a batched completions request) is
one engine request. Validation and submission happen before any byte is sent, so every refusal
is a proper HTTP error; once a stream has started, a failure becomes an `error` event, then [DONE]."""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import Request

from ninfer.server.agent import ChatPlan, plan_for
from ninfer.server.async_engine import RequestStream
from ninfer.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                    ChatLogprob, ChatStreamChoice, ChoiceLogprobs,
                                    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                    DeltaMessage, PromptTokensDetails, Usage)
from ninfer.server.serving import APIError, OpenAIServing, Tracker, message_texts

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_CHOICES = 128   # n x prompts of one HTTP request
SEED_RANGE = 1 << 63


@dataclass
class Choice:
    index: int
    tracker: Tracker
    prompt_ids: list[int]
    params: Any
    counts_prompt: bool          # the first sample of its prompt: its prompt tokens go into usage
    echo: str = ""
    stream: RequestStream | None = None
    offset: int = 0              # completions: text_offset of the next token


def _usage(choices: list[Choice]) -> Usage:
    prompt = sum(c.tracker.prompt_tokens for c in choices if c.counts_prompt)
    cached = sum(c.tracker.cached_tokens for c in choices if c.counts_prompt)
    completion = sum(c.tracker.completion_tokens for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _sse(payload: Any) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def _new_logprobs(last: Any, n_new: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """The last `n_new` generated token ids, their chosen-token logprobs and, when asked for, the
    top alternatives (RequestOutput.logprobs / .top_logprobs hold all so far, aligned with token_ids)."""
    end = len(last.token_ids)
    start = max(0, end - n_new)
    tops = getattr(last, "top_logprobs", None)
    return (list(last.token_ids[start:end]), list((last.logprobs or [])[start:end]),
            None if tops is None else list(tops[start:end]))


def _n_new(steps: list[Any]) -> int:
    return sum(len(s.output.new_token_ids) for s in steps)


def _token_strs(tok: Any, ids: list[int]) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


async def _strs(sv: OpenAIServing, ids: list[int], tops: list[list[tuple[int, float]]] | None,
                ) -> tuple[list[str], list[list[tuple[str, float]]] | None]:
    def work() -> tuple[list[str], list[list[tuple[str, float]]] | None]:
        tok = sv.tokenizer
        alts = None if tops is None else [list(zip(_token_strs(tok, [i for i, _ in t]), (lp for _, lp in t)))
                                          for t in tops]
        return _token_strs(tok, ids), alts
    return await sv.on_tokenizer(work)


async def _chat_logprobs(sv: OpenAIServing, ids: list[int], lps: list[float],
                         tops: list[list[tuple[int, float]]] | None) -> ChoiceLogprobs:
    strs, alts = await _strs(sv, ids, tops)
    return ChoiceLogprobs(content=[
        ChatLogprob(token=s, logprob=lp, bytes=list(s.encode("utf-8")),
                    top_logprobs=[{"token": a, "logprob": alp, "bytes": list(a.encode("utf-8"))}
                                  for a, alp in (alts[k] if alts else [])])
        for k, (s, lp) in enumerate(zip(strs, lps))])


async def _completion_logprobs(sv: OpenAIServing, ids: list[int], lps: list[float],
                               tops: list[list[tuple[int, float]]] | None, offset: int) -> CompletionLogprobs:
    strs, alts = await _strs(sv, ids, tops)
    offsets, pos = [], offset
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    # OpenAI's shape: one {token: logprob} dict per position (null when logprobs=0 asked for none);
    # ids that decode alike (partial UTF-8 bytes) keep the likeliest one's logprob
    top = [dict(reversed(a)) for a in alts] if alts is not None else [None] * len(strs)
    return CompletionLogprobs(tokens=strs, token_logprobs=list(lps), top_logprobs=top, text_offset=offsets)


def _stream_flags(req: Any) -> tuple[bool, bool]:
    so = req.stream_options
    return bool(so and so.include_usage), bool(so and so.continuous_usage_stats)


def _samples(sv: OpenAIServing, parent: Tracker, n: int, first_index: int, prompt_ids: list[int], params: Any,
             echo: str = "") -> list[Choice]:
    """n choices of one prompt; a seeded request gets seeds seed, seed+1, ... so samples differ."""
    out = []
    for j in range(n):
        idx = first_index + j
        tr = parent if idx == 0 else dataclasses.replace(parent, request_id=f"{parent.request_id}-{idx}")
        tr.prompt_tokens = len(prompt_ids)
        p = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % SEED_RANGE)
        out.append(Choice(idx, tr, prompt_ids, p, counts_prompt=j == 0, echo=echo, offset=len(echo)))
    return out


async def _submit_all(sv: OpenAIServing, choices: list[Choice]) -> None:
    """All or nothing: if one choice is refused (e.g. 429), the ones already queued are aborted."""
    try:
        for ch in choices:
            ch.stream = await sv.submit(ch.tracker, ch.prompt_ids, ch.params)
    except BaseException:
        for ch in choices:
            if ch.stream is not None:
                await sv.close_stream(ch.stream, ch.tracker)
        raise


def _refused(sv: OpenAIServing, parent: Tracker, choices: list[Choice], err: APIError) -> None:
    sv.fail(next((c.tracker for c in choices if c.stream is None), parent), err)


async def _close_all(sv: OpenAIServing, choices: list[Choice]) -> None:
    for ch in choices:
        await sv.close_stream(ch.stream, ch.tracker)


def _check_n(n: int, prompts: int = 1) -> None:
    if n * prompts > MAX_CHOICES:
        raise APIError(400, f"n x prompts = {n * prompts} exceeds the limit of {MAX_CHOICES} choices per request",
                       param="n")


async def _respond(sv: OpenAIServing, raw: Request, req: Any, parent: Any, choices: list[Choice],
                   stream: Callable[..., AsyncIterator[str]], make_choice: Callable[..., Awaitable[Any]],
                   response_cls: type) -> Any:
    """The tail shared by chat and completions: an SSE stream, or wait for every choice and answer once."""
    model, created = sv.config.served_model_name, int(time.time())
    if req.stream:
        return StreamingResponse(stream(sv, req, choices, parent.request_id, model, created),
                                 media_type="text/event-stream", headers=_SSE_HEADERS,
                                 background=BackgroundTask(_close_all, sv, choices))
    lasts = await sv.run_until_done(raw, [(c.stream, c.tracker) for c in choices])
    if lasts is None:
        return Response(status_code=499)   # the client is gone; nothing will read this
    out = [await make_choice(ch, last) for ch, last in zip(choices, lasts)]
    resp = response_cls(id=parent.request_id, created=created, model=model, usage=_usage(choices), choices=out)
    return JSONResponse(resp.model_dump())


# ------------------------------------------------------------------------------------ chat


async def create_chat_completion(sv: OpenAIServing, req: ChatCompletionRequest, raw: Request) -> Any:
    parent = sv.new_tracker("chatcmpl", "chat", time.monotonic())
    parent.stream = req.stream
    choices: list[Choice] = []
    try:
        sv.check_model(req.model)
        sv.log_ignored(req, parent)
        _check_n(req.n)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                           param="continue_final_message")
        sv.check_text_fits(message_texts(req.messages), "messages")
        plan = plan_for(sv, req)   # tools, tool_choice, response_format, reasoning
        prompt_ids = await sv.on_tokenizer(sv.chat_prompt_ids, req.messages,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           template_kwargs=plan.template_kwargs)
        parent.prompt_tokens = len(prompt_ids)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sv.sampling_params(req, len(prompt_ids), max_tokens, param="messages",
                                    logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        params = await plan.constrain(sv, params, prompt_ids)
        choices = _samples(sv, parent, req.n, 0, prompt_ids, params)
        await _submit_all(sv, choices)
    except APIError as e:
        _refused(sv, parent, choices, e)
        raise

    async def make_choice(ch: Choice, last: Any) -> ChatChoice:
        logprobs = await _chat_logprobs(sv, *_new_logprobs(last, len(last.token_ids))) if req.logprobs else None
        message, finish = plan.message(last.text, last.finish_reason)
        return ChatChoice(index=ch.index, message=message, logprobs=logprobs, finish_reason=finish)

    return await _respond(sv, raw, req, parent, choices, functools.partial(_chat_stream, plan=plan), make_choice,
                          ChatCompletionResponse)


async def _chat_stream(sv: OpenAIServing, req: ChatCompletionRequest, choices: list[Choice], rid: str,
                       model: str, created: int, *, plan: ChatPlan) -> AsyncIterator[str]:
    include_usage, continuous = _stream_flags(req)
    outs = {ch.index: plan.streamer() for ch in choices}   # reasoning / tool-call split per choice

    def chunk(index: int, delta: DeltaMessage | None, finish: str | None = None,
              logprobs: ChoiceLogprobs | None = None) -> str:
        return _sse(ChatCompletionChunk(
            id=rid, created=created, model=model, usage=_usage(choices) if continuous else None,
            choices=[ChatStreamChoice(index=index, delta=delta or DeltaMessage(), logprobs=logprobs,
                                      finish_reason=finish)]))

    try:
        for ch in choices:
            yield chunk(ch.index, DeltaMessage(role="assistant", content=""))
        async for i, last, steps in sv.merged_outputs([(c.stream, c.tracker) for c in choices]):
            index = choices[i].index
            text = "".join(s.output.new_text for s in steps)
            lp = None
            if req.logprobs and _n_new(steps):
                lp = await _chat_logprobs(sv, *_new_logprobs(last, _n_new(steps)))
            deltas = outs[index].feed(text) if text else []
            for k, delta in enumerate(deltas or ([DeltaMessage()] if lp is not None else [])):
                yield chunk(index, delta, logprobs=lp if k == 0 else None)
            if last.finished:
                deltas, finish = outs[index].finish(last.finish_reason)
                for delta in deltas:
                    yield chunk(index, delta)
                yield chunk(index, None, finish=finish)
        if include_usage:
            yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=_usage(choices)))
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------ completions


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, token ids, a list of strings, a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def create_completion(sv: OpenAIServing, req: CompletionRequest, raw: Request) -> Any:
    parent = sv.new_tracker("cmpl", "completions", time.monotonic())
    parent.stream = req.stream
    choices: list[Choice] = []
    try:
        sv.check_model(req.model)
        sv.log_ignored(req, parent)
        prompts = _prompt_list(req.prompt)
        _check_n(req.n, len(prompts))
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs needs prompt logprobs, which are not supported",
                           param="echo")
        for prompt in prompts:      # each prompt is its own request: each must fit alone
            sv.check_text_fits([prompt] if isinstance(prompt, str) else [], "prompt")
        for prompt in prompts:
            prompt_ids = await sv.on_tokenizer(sv.prompt_ids, prompt, req.add_special_tokens)
            if not prompt_ids:
                raise APIError(400, "prompt is empty after tokenization", param="prompt")
            params = sv.sampling_params(req, len(prompt_ids), req.max_tokens, param="prompt",
                                        logprobs=req.logprobs)
            echo = ""
            if req.echo:
                echo = prompt if isinstance(prompt, str) else await sv.on_tokenizer(lambda: sv.tokenizer.decode(prompt))
            choices += _samples(sv, parent, req.n, len(choices), prompt_ids, params, echo)
        await _submit_all(sv, choices)
    except APIError as e:
        _refused(sv, parent, choices, e)
        raise

    async def make_choice(ch: Choice, last: Any) -> CompletionChoice:
        logprobs = None
        if req.logprobs is not None:
            logprobs = await _completion_logprobs(sv, *_new_logprobs(last, len(last.token_ids)), len(ch.echo))
        return CompletionChoice(index=ch.index, text=ch.echo + last.text, logprobs=logprobs,
                                finish_reason=last.finish_reason)

    return await _respond(sv, raw, req, parent, choices, _completion_stream, make_choice, CompletionResponse)


async def _completion_stream(sv: OpenAIServing, req: CompletionRequest, choices: list[Choice], rid: str,
                             model: str, created: int) -> AsyncIterator[str]:
    include_usage, continuous = _stream_flags(req)

    def chunk(index: int, text: str, finish: str | None = None, logprobs: CompletionLogprobs | None = None) -> str:
        return _sse(CompletionResponse(id=rid, created=created, model=model,
                                       usage=_usage(choices) if continuous else None,
                                       choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                                 finish_reason=finish)]))

    try:
        for ch in choices:
            if ch.echo:
                yield chunk(ch.index, ch.echo)
        async for i, last, steps in sv.merged_outputs([(c.stream, c.tracker) for c in choices]):
            ch = choices[i]
            text = "".join(s.output.new_text for s in steps)
            lp = None
            if req.logprobs is not None and _n_new(steps):
                lp = await _completion_logprobs(sv, *_new_logprobs(last, _n_new(steps)), ch.offset)
            ch.offset += len(text)
            if text or lp is not None:
                yield chunk(ch.index, text, logprobs=lp)
            if last.finished:
                yield chunk(ch.index, "", finish=last.finish_reason)
        if include_usage:
            yield _sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=_usage(choices)))
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"
