"""Continuous batching under a token budget (vLLM v1's policy, simplified).

Each step spends at most `max_num_batched_tokens` new tokens. Running requests go first, in
arrival order: a decoding request takes one token, a request still prefilling takes the next
chunk of its prompt (chunked prefill applies to every request, not only the first). Waiting
requests are admitted after that, while budget, `max_num_seqs` and free pages last; a newly
admitted request first takes whatever full pages of its prompt the prefix cache already holds.
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


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0          # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0             # of those, tokens served from it

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
        budget = self.max_num_batched_tokens
        reqs: list[Request] = []
        counts: list[int] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n > 0, f"running request {req.request_id} has nothing to compute"
            while not self.bm.may_append(req):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self.bm.append_slot(req)
                reqs.append(req)
                counts.append(n)
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: it was the last running request
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                # Pages for every token the request has (prompt, plus output after a preemption)
                # are taken at admission, so a long prefill cannot stall halfway for lack of pages.
                if not self.bm.can_allocate(req):
                    break
                cached = self.bm.allocate(req)
                if req.num_preemptions == 0:
                    req.prefix_hit_tokens = cached
                    self.prefix_queries += req.num_prompt_tokens
                    self.prefix_hits += cached
                req.num_computed_tokens = cached
                n = min(req.num_tokens - cached, budget)
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                reqs.append(req)
                counts.append(n)
                budget -= n
        return ScheduledBatch(reqs, counts)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and publish the pages the step filled to the prefix cache."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.bm.mark_computed(req, req.num_computed_tokens)
