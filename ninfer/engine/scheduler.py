"""Continuous batching under a token budget (vLLM v1's chunked-prefill policy, with fairer prefills).

Each step spends at most `token_budget` new tokens (<= `max_num_batched_tokens`). Decodes go
first: every running request that has a token to sample takes its one token, in arrival order, so
a long prefill never delays them by more than one step. Prefills share what is left: running
requests still prefilling, then waiting requests admitted while `max_num_seqs`, the budget and free
pages last (a newly admitted request first takes whatever full pages of its prompt the prefix cache
already holds). Among prefills the one with the fewest tokens left goes first (a short prompt
arriving during a long one gets its first token next step), except that the oldest prefill always
keeps half the prefill budget, so a stream of short prompts cannot starve a long one; equal long
prompts run first come, first served.

A step that carries decodes spends at most MIXED_STEP_TOKENS, so running streams keep their
inter-token latency while a long prompt prefills; a step with no decode may use the whole budget
(larger chunks prefill a lone long prompt faster: fewer, fuller matmuls and attention calls).

`token_budget` is fixed at `max_num_batched_tokens` unless a target step time is set
(`set_target_step_time`, the server does it on CPU): then it follows the measured step time, so a
long prompt is cut into steps of about that length and a newcomer or an abort waits at most one of
them, however slow the device or long the context.

When a running request needs a page and none is free, the most recently arrived running request
is preempted by recompute: its pages go back, its generated tokens stay, and it returns to the
front of the waiting queue to prefill prompt + output again. No waiting request is admitted in a
step that preempted (it would only be preempted again).

Invariants (tested in tests/test_scheduler.py): every page is owned by live requests or free
(nothing leaks after finish, abort or preemption); a page written this step is never shared.
"""
from __future__ import annotations

from collections import deque

from ninfer.engine.model_runner import ScheduledBatch
from ninfer.engine.request import Request, RequestStatus
from ninfer.kvcache.block_manager import BlockManager


MIN_PREFILL_TOKENS = 16      # a prefill advances at least this much per step, whatever the timing
MIXED_STEP_TOKENS = 8192     # most new tokens in a step that also decodes


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.token_budget = max_num_batched_tokens
        self.target_step_s: float | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0          # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0             # of those, tokens served from it

    # -- step-time control ----------------------------------------------------------------------
    def set_target_step_time(self, seconds: float | None, start_budget: int = 256) -> None:
        """Adapt `token_budget` so that steps with prefill work take about `seconds` (None: fixed)."""
        if seconds is not None and not seconds > 0:
            raise ValueError(f"target step time must be > 0 seconds, got {seconds}")
        self.target_step_s = seconds
        self.token_budget = self.max_num_batched_tokens if seconds is None else \
            max(1, min(self.max_num_batched_tokens, start_budget))

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """Feed back how long `batch` took. Only steps that prefilled teach anything: a slow step
        shrinks the budget in proportion; a fast one grows it (at most 2x) if the budget bound it."""
        target = self.target_step_s
        if target is None or seconds <= 0 or batch.is_decode:
            return
        tokens = batch.total_tokens
        if seconds > target:
            budget = int(tokens * target / seconds)
        elif tokens >= self.token_budget:
            budget = int(self.token_budget * min(2.0, target / seconds))
        else:
            return
        self.token_budget = max(1, min(self.max_num_batched_tokens, budget))

    # -- queue management -----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.finish("abort")
        self._remove(req)
        return req

    def finish(self, req: Request) -> None:
        """Release a request the engine marked finished (stop, length, error)."""
        assert req.is_finished, req.request_id
        self._remove(req)

    def _remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req)
        self.requests.pop(req.request_id, None)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        cap = self.max_num_batched_tokens
        reqs: list[Request] = []
        counts: list[int] = []
        prefills: list[Request] = []     # running requests still prefilling, then admitted ones
        preempted = False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            assert n > 0, f"running request {req.request_id} has nothing to compute"
            if n == 1 and len(reqs) >= cap:   # more decodes than the hard cap: the rest wait a step
                i += 1
                continue
            while not self.bm.may_append(req):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self.bm.append_slot(req)
                if n == 1:
                    reqs.append(req)
                    counts.append(1)
                else:
                    prefills.append(req)
                i += 1
                continue
            break  # req itself was preempted: it was the last running request
        if reqs:
            cap = min(cap, max(MIXED_STEP_TOKENS, len(reqs) + MIN_PREFILL_TOKENS))
        budget = min(cap - len(reqs), max(self.token_budget - len(reqs), MIN_PREFILL_TOKENS))
        wants = [r.num_tokens - r.num_computed_tokens for r in prefills]
        if not preempted:
            while self.waiting and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                # Admit only what gets tokens this step (pages are held from admission on). Pages
                # for every token the request has (prompt, plus output after a preemption) are
                # taken at admission, so a long prefill cannot stall halfway for lack of pages.
                if not prefill_shares(wants + [req.num_tokens], budget)[-1] or not self.bm.can_allocate(req):
                    break
                cached = self.bm.allocate(req)
                if req.num_preemptions == 0:
                    req.prefix_hit_tokens = cached
                    self.prefix_queries += req.num_prompt_tokens
                    self.prefix_hits += cached
                req.num_computed_tokens = cached
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                prefills.append(req)
                wants.append(req.num_tokens - cached)
        for req, n in zip(prefills, prefill_shares(wants, budget)):
            if n:
                reqs.append(req)
                counts.append(n)
        return ScheduledBatch(reqs, counts)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and publish the pages the step filled to the prefix cache."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.bm.mark_computed(req, req.num_computed_tokens)


def prefill_shares(wants: list[int], budget: int) -> list[int]:
    """Tokens for each prefill (`wants` in arrival order): the oldest keeps half the budget, then the
    fewest-remaining go first (ties by arrival). Never more than wanted, never more than `budget`."""
    shares = [0] * len(wants)
    if not wants or budget <= 0:
        return shares
    shares[0] = min(wants[0], budget // 2)
    left = budget - shares[0]
    for i in sorted(range(len(wants)), key=lambda i: (wants[i] - shares[i], i)):
        extra = min(wants[i] - shares[i], left)
        shares[i] += extra
        left -= extra
    return shares
