"""Grammar-constrained decoding through xgrammar: a compile cache shared by the server and the
engine, the per-request matcher, and the token bitmask the sampler applies.

A constrained request carries a `StructuredSpec` in its SamplingParams. Compilation is the slow
part (milliseconds to seconds for a large schema), so it runs on the cache's own thread and its
result is kept per spec: the server awaits it before submitting (a bad schema is a 400 there,
never an engine failure), and the engine's lookup at add_request is then a dictionary hit.
The per-step work is one bitmask fill for the constrained rows and one masked fill of their
logits; a batch without a constrained row never reaches this module.

xgrammar is imported on first use only, so installs and GPU hosts without it run everything else."""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import torch

KINDS = ("json_object", "json_schema", "regex", "grammar", "structural_tag")


class StructuredError(ValueError):
    """The constraint cannot be compiled (bad schema, regex, grammar): the client's mistake.
    `reason` is the compiler's own words, without its source location."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


@dataclass(frozen=True)
class StructuredSpec:
    """What to constrain the output to. `value`: the schema / structural tag as canonical JSON,
    the regex, or the EBNF grammar; unused for json_object (any JSON object)."""
    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredError(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")

    @classmethod
    def from_json(cls, kind: str, obj: Any) -> "StructuredSpec":
        """A schema or structural tag given as a dict (or pydantic model), as compact JSON. Keys keep
        their order: a schema's property order is the order the grammar generates them in."""
        if hasattr(obj, "model_dump"):
            obj = obj.model_dump(mode="json", exclude_none=True)
        return cls(kind, obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":")))


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise StructuredError("structured output needs the xgrammar package (pip install 'ninfer[structured]')") from e
    return xgrammar


class GrammarCache:
    """Compiled grammars by spec, compiled on one background thread; thread-safe.

    `vocab_size` is the model's logits width (it may exceed the tokenizer's length: the padded ids
    are then always masked). `stop_token_ids` end a grammar (the model's EOS ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], *, max_entries: int = 512,
                 tokenizer_info: Any = None) -> None:
        self.vocab_size = int(vocab_size)
        self._tokenizer = tokenizer
        self._info = tokenizer_info         # an xgrammar TokenizerInfo to use instead of the tokenizer's
        self._stop = sorted(int(t) for t in stop_token_ids)
        self._max = max_entries
        self._lock = threading.Lock()
        self._futures: OrderedDict[StructuredSpec, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None

    def submit(self, spec: StructuredSpec) -> Future:
        """A future of the CompiledGrammar (raising StructuredError); the same future for equal specs."""
        with self._lock:
            fut = self._futures.get(spec)
            if fut is not None:
                self._futures.move_to_end(spec)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ninfer-grammar")
            fut = self._pool.submit(self._compile, spec)
            self._futures[spec] = fut
            while len(self._futures) > self._max:
                self._futures.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_failure(spec, f))
        return fut

    def compile(self, spec: StructuredSpec) -> Any:
        return self.submit(spec).result()

    def _forget_failure(self, spec: StructuredSpec, fut: Future) -> None:
        # A failed spec is not kept: the next request with it gets the error again, freshly.
        if fut.exception() is not None:
            with self._lock:
                if self._futures.get(spec) is fut:
                    del self._futures[spec]

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self._tokenizer is None and self._info is None:
                raise StructuredError("structured output needs the model's tokenizer (this checkpoint has none)")
            xgr = _xgr()
            info = self._info or xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                                    stop_token_ids=self._stop or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def _compile(self, spec: StructuredSpec) -> Any:
        comp = self._get_compiler()
        try:
            # JSON without free whitespace: what models emit anyway, and a weak model cannot spend
            # its whole budget on blanks between tokens.
            if spec.kind == "json_object":
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                return comp.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "regex":
                return comp.compile_regex(spec.value)
            if spec.kind == "grammar":
                return comp.compile_grammar(spec.value)
            return comp.compile_structural_tag(spec.value)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
            lines = str(e).strip().splitlines()
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(e).__name__
            raise StructuredError(f"invalid {spec.kind.replace('_', ' ')}: {reason}", reason) from e

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's place in its grammar (an xgrammar GrammarMatcher)."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgr().GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self.matcher.is_terminated())


class BitmaskFiller:
    """Fills one int32 bitmask row per constrained row of a step; the buffer is reused across steps
    (grown when a larger batch comes) and each row is filled by its own matcher."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)
        self._buf: torch.Tensor | None = None
        self._batch: Any = None

    def fill(self, states: list[GrammarState]) -> torch.Tensor:
        xgr = _xgr()
        n = len(states)
        if self._buf is None or self._buf.shape[0] < n:
            self._buf = xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
        mask = self._buf[:n]
        if n == 1:
            states[0].matcher.fill_next_token_bitmask(mask, 0)
        else:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], mask)
        return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0 (in place)."""
    packed = bitmask.to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((packed[:, :, None] >> shifts) & 1).reshape(packed.shape[0], -1)[:, :vocab].bool()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device) if rows != list(range(len(rows))) else None
    if idx is None:
        logits[: len(rows)].masked_fill_(~allowed, -float("inf"))
    else:
        logits[idx] = logits[idx].masked_fill(~allowed, -float("inf"))
