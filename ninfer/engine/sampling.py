"""Sampling parameters (vLLM's field names) and the batched sampler.

The sampler turns one float32 logits row per sampled sequence into a token id. Order, as vLLM
and transformers apply them: penalties (repetition over prompt+output, presence/frequency over
output) -> greedy argmax when temperature == 0, else temperature -> top-k -> top-p -> min-p ->
a draw from the request's own `torch.Generator`, so a seeded request yields the same tokens
whatever else shares its batch. Logprobs are of the chosen token under the *raw* model
distribution (before penalties and temperature), as vLLM reports them by default."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM uses the same cut-off)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None = up to the engine's max_context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None          # not None = the chosen token's logprob per step, and the top N
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0                  # EOS / stop tokens are masked until this many tokens exist
    structured: Any = None               # a ninfer.engine.structured.StructuredSpec: grammar-constrained output

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if self.min_tokens is None:  # API layers pass unset fields as None
            self.min_tokens = 0
        self.ignore_eos = bool(self.ignore_eos)
        self.skip_special_tokens = True if self.skip_special_tokens is None else bool(self.skip_special_tokens)
        self.include_stop_str_in_output = bool(self.include_stop_str_in_output)
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.structured is not None and not hasattr(self.structured, "kind"):
            raise ValueError(f"structured must be a StructuredSpec, got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Repetition / presence / frequency penalties: the only readers of a row's output ids."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence being sampled this step."""
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]          # EOS/stop tokens masked while below min_tokens


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    bad_rows: list[int]                  # rows whose logits held NaN/Inf: nothing sampled for them
    top_logprobs: list[list[tuple[int, float]] | None] | None = None  # per row: the N likeliest (id, logprob)


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                            dtype=torch.long, device=logits.device)
        if seen.numel():
            vals = logits[seen]
            # transformers' RepetitionPenaltyLogitsProcessor: shrink positive logits, grow negative ones
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if row.banned_token_ids:
        logits[torch.tensor(row.banned_token_ids, dtype=torch.long, device=logits.device)] = -float("inf")
    return logits


def _filter_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """temperature -> top-k -> top-p -> min-p; returns a probability row."""
    logits = logits / p.temperature
    vocab = logits.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_probs)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _needs_penalties(row: SampleRow) -> bool:
    return row.params.penalized or bool(row.banned_token_ids)


def sample(logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None = None,
           bitmask_rows: list[int] | None = None) -> SampleResult:
    """logits [N, V] float32, one row per entry of `rows` -> one token id per row.

    `bitmask` (int32 [len(bitmask_rows), ceil(V/32)], from ninfer.engine.structured) constrains the
    rows `bitmask_rows` to a grammar: a 0 bit sets that token's logit to -inf before anything else.
    A batch without constrained rows passes None and pays nothing.

    Greedy rows without penalties take one batched argmax; the others are drawn row by row with
    their own generator. Everything stays on the logits' device until one final host copy (no
    per-row sync)."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
    n = len(rows)
    logits = logits.float()
    finite = torch.isfinite(logits).all(dim=-1)   # before the mask: its -inf are not garbage
    if bitmask is not None:
        from ninfer.engine.structured import apply_bitmask
        apply_bitmask(logits, bitmask, bitmask_rows or [])
    penalized = [i for i, r in enumerate(rows) if _needs_penalties(r)]
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    x = logits
    if penalized or len(greedy) < n:
        # Non-finite rows are reported, not sampled; zeroing them keeps multinomial from raising.
        # (An all-greedy batch skips it: a non-finite row's argmax is discarded either way.)
        x = torch.where(finite[:, None], logits, torch.zeros((), device=logits.device))
        for i in penalized:  # x is a fresh tensor here: the penalties may write it in place
            x[i] = _apply_penalties(x[i], rows[i])
    if len(greedy) == n:
        tokens = x.argmax(dim=-1)
    else:
        tokens = torch.zeros(n, dtype=torch.long, device=logits.device)
        if greedy:
            idx = torch.tensor(greedy, dtype=torch.long, device=logits.device)
            tokens[idx] = x[idx].argmax(dim=-1)
        for i, r in enumerate(rows):
            if not r.params.greedy:
                probs = _filter_probs(x[i], r.params)
                tokens[i] = torch.multinomial(probs, 1, generator=r.generator)[0]
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    lp = top = None
    top_n = max((rows[i].params.logprobs or 0) for i in want_lp) if want_lp else 0
    if want_lp:
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(1, tokens[:, None])[:, 0]
        if top_n:   # alternatives only when asked for: an extra host copy
            top = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
    # One device->host copy (the step's only sync); stack promotes in its own kernel (to int64, or
    # to float64 with logprobs: exact for any token id).
    host = torch.stack([tokens, finite] + ([lp.double()] if lp is not None else [])).cpu()
    token_ids = [int(t) for t in host[0].tolist()]
    ok = [bool(f) for f in host[1].tolist()]
    lps = host[2].tolist() if lp is not None else [None] * n
    logprobs: list[float | None] = [lps[i] if (rows[i].params.logprobs is not None and ok[i]) else None
                                    for i in range(n)]
    bad = [i for i in range(n) if not ok[i]]
    for i in bad:
        token_ids[i] = -1
    tops = None
    if top is not None:
        vals, ids = top.values.double().cpu().tolist(), top.indices.cpu().tolist()
        tops = [list(zip(ids[i][:k], vals[i][:k])) if (k := rows[i].params.logprobs or 0) and ok[i] else None
                for i in range(n)]
    return SampleResult(token_ids, logprobs, bad, tops)
