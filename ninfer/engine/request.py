"""A request's life inside the engine, and what the engine hands back.

`Request` is the scheduler's unit: prompt + generated tokens, how many of them are already in
the KV cache (`num_computed_tokens`), its page table (`block_table`), its sampler state and its
detokenizer. Preemption by recompute keeps the generated tokens and only resets
`num_computed_tokens` and the pages, so the request resumes by prefilling prompt + output.
`RequestOutput` follows ARCHITECTURE.md (engine side) and also offers vLLM's
`.outputs[0].text / .token_ids / .finish_reason / .logprobs` view for `LLM.generate`."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.engine.detokenizer import IncrementalDetokenizer
from ninfer.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 max_tokens: int, eos_token_ids: frozenset[int], generator: torch.Generator | None,
                 detokenizer: IncrementalDetokenizer | None, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens          # resolved (params.max_tokens or what max_context leaves)
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.detokenizer = detokenizer
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output, what the cache must hold
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []   # when params.logprobs > 0
        self.num_computed_tokens = 0          # tokens whose K/V are in the cache
        self.prefix_hit_tokens = 0            # prompt tokens served by the prefix cache at first admission
        # BlockManager's Sequence protocol: it owns and rewrites these two
        self.block_table: list[int] = []      # page ids, in order
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.first_token_time: float | None = None
        self._sent_tokens = 0                 # output tokens already reported in a RequestOutput
        self.grammar: Any = None              # GrammarState (ninfer.engine.structured) of a constrained request

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def seq_id(self) -> str:  # BlockManager's Sequence protocol
        return self.request_id

    # -- state changes --------------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: float | None,
                     top_logprobs: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(int(token_id))
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: str, stop_reason: str | int | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def make_output(self) -> "RequestOutput":
        out_ids = self.output_token_ids
        new_ids = out_ids[self._sent_tokens:]
        self._sent_tokens = len(out_ids)
        finished = self.is_finished
        new_text = self.detokenizer.take_new_text(finished) if self.detokenizer else ""
        text = self.detokenizer.text[: self.detokenizer.emitted] if self.detokenizer else ""
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            token_ids=out_ids, new_token_ids=new_ids, text=text, new_text=new_text,
            finished=finished, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            num_cached_tokens=self.prefix_hit_tokens,
            logprobs=list(self.output_logprobs) if self.params.logprobs is not None else None,
            top_logprobs=list(self.output_top_logprobs) if self.params.logprobs else None,
            error=self.error,
        )


@dataclass
class CompletionOutput:
    """vLLM's per-sample view (we produce one sample per request)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(self.logprobs) if self.logprobs is not None else None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # all generated so far
    new_token_ids: list[int]              # generated since the previous output of this request
    text: str                             # all text so far (held back while a stop string may be forming)
    new_text: str
    finished: bool
    finish_reason: str | None             # "stop" | "length" | "abort" | "error" | None
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None   # chosen-token logprob per generated token, on request
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: the N likeliest (id, logprob)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None              # set when finish_reason == "error"
    prompt: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs)]
