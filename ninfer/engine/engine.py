"""LLMEngine: the synchronous engine core (tokenizer, model, KV pool, scheduler, sampler).

Startup order matters: config.json is read and the memory plan made (refusing a context that does
not fit, with the numbers) before any weight or KV page is allocated; then the model is loaded, the
pool allocated from the plan, its plane geometry asserted against the format entry and logged
(DESIGN 2.2), and the capacity line logged (DESIGN 3). `startup_lines` keeps those lines for the
CLI and the server. The engine is driven from one thread: add_request / abort_request / step."""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ninfer.config import DEFAULT_MODEL_DIR, PAGE_SIZE, EngineConfig
from ninfer.distributed.step_message import StepEncoder
from ninfer.engine.detokenizer import IncrementalDetokenizer
from ninfer.engine.rank import RankSetup, build_rank, capture_graphs, centre_keys
from ninfer.engine.request import Request, RequestOutput
from ninfer.engine.sampling import SampleRow, SamplingParams, sample
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.structured import BitmaskFiller, GrammarCache, GrammarState
from ninfer.kvcache.block_manager import BlockManager
from ninfer.kvcache.formats import KVFormat, get_format
from ninfer.kvcache.planner import MemoryPlan, device_memory, plan_for_engine
from ninfer.kvcache.spec import CacheSpec
from ninfer.model_config import ModelConfig
from ninfer.engine import cpu, tp
from ninfer.models.loader import resolve_dtype
from ninfer.layers.rotary import apply_rope_overrides, scaled_max_position

log = logging.getLogger("ninfer.engine")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CPU_AUTO_SEQS = 4  # --kv-capacity auto on CPU: room for max_context x min(max_num_seqs, this)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float            # fraction of pages held by live requests
    kv_capacity_tokens: int
    num_total_pages: int
    num_free_pages: int
    prefix_cache_queries: int        # prompt tokens looked up (first admission of each request)
    prefix_cache_hits: int           # of those, served from cached pages
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    num_steps: int
    num_total_state_slots: int | None = None   # recurrent-state slots (models with linear-attention layers)
    num_free_state_slots: int | None = None


def default_model_dir() -> Path:
    """The bundled probe model."""
    return DEFAULT_MODEL_DIR


def _eos_token_ids(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)




def declared_cache_spec(mc: ModelConfig, fmt: KVFormat) -> CacheSpec:
    """The model's cache spec before any weight exists: from an instance on the meta device."""
    from ninfer.models.registry import get_model_class
    with torch.device("meta"):
        model = get_model_class(mc.architecture)(mc)
    return model.cache_specs(fmt)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        self.config = config
        self.kv_format = get_format(config.kv_dtype)        # unknown / refused names fail first
        self.tp_size = config.tensor_parallel_size
        devices = tp.rank_devices(cpu.resolve_device(config.device), self.tp_size)
        self.device = devices[0]
        self._group: Any = None   # the follower ranks (ninfer.distributed.group), with tensor parallelism
        if config.model:
            from ninfer.checkpoints import resolve_model
            self.model_dir = resolve_model(config.model, progress=progress)
        else:
            self.model_dir = default_model_dir()
            if not (self.model_dir / "config.json").is_file():
                raise ValueError(f"no model given and the bundled probe model is missing at {self.model_dir}; "
                                 "pass a model directory (an HF checkpoint with config.json)")
        mc = apply_rope_overrides(ModelConfig.load(self.model_dir), config.rope_yarn_factor,
                                  config.rope_original_max_position)
        self.dtype = resolve_dtype(config.dtype, mc)
        host = ""
        if self.device.type == "cpu":
            why = _DTYPE_NAMES.get(self.dtype, str(self.dtype))
            if config.dtype == "auto":
                self.dtype, why = cpu.compute_dtype(self.dtype)
            threads, src = tp.threads_per_rank(*cpu.configure_threads(config.threads), self.tp_size)
            host = f" dtype={why} threads={threads} ({src})"
        model_limit = scaled_max_position(mc)
        self.max_context = int(config.max_context or model_limit)
        if self.max_context > model_limit:
            log.warning("max_context=%d exceeds the model's %d positions (rope scaling included); "
                        "quality past %d tokens is not what the model was trained for",
                        self.max_context, model_limit, model_limit)
        try:
            self._start(mc, devices, progress, host)
        except BaseException:
            self.shutdown()   # the followers go with a failed start
            raise
        self._seed_rng = random.Random(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        # Test/bench hook: called with (requests that sample, their float32 logits [N, V]) each step.
        self.logits_hook: Callable[[list[Request], torch.Tensor], None] | None = None

    def _start(self, mc: ModelConfig, devices: list[torch.device], progress: bool, host: str) -> None:
        config = self.config
        mem = device_memory(self.device, config.memory_limit_gib)
        if self.tp_size > 1:   # the group first: the model and its plan are per rank (tp_size())
            from ninfer.distributed.group import WorkerGroup
            self._group = WorkerGroup(self.tp_size, devices, torch.get_num_threads())
            self._encoder = StepEncoder()
            mem = tp.least_memory(mem, self._group.memories, self.device.type, self.tp_size)
        # Plan before allocating anything big: ContextDoesNotFit carries the numbers.
        self.cache_spec = declared_cache_spec(mc, self.kv_format)
        plan_cfg = config.replace(dtype=_DTYPE_NAMES[self.dtype])
        self.plan: MemoryPlan = plan_for_engine(mc, plan_cfg, mem, self.device.type, max_context=self.max_context,
                                                cache_spec=self.cache_spec)
        if self.device.type == "cpu" and config.kv_capacity == "auto":
            # A CPU run holds a few requests, not a GPU's worth: size the pool for what is asked.
            pages = -(-self.max_context // PAGE_SIZE) * min(config.max_num_seqs, CPU_AUTO_SEQS)
            if pages < self.plan.num_pages:
                self.plan = dataclasses.replace(
                    plan_for_engine(mc, plan_cfg.replace(kv_capacity=pages * PAGE_SIZE), mem, "cpu",
                                    max_context=self.max_context, cache_spec=self.cache_spec), capacity_mode="auto")

        # Every rank builds its parts from this one setup (the followers get it on their pipe).
        setup = RankSetup(config, self.model_dir, self.dtype, self.max_context, self.plan, self.cache_spec)
        if self._group is not None:
            self._group.setup(setup)
        parts = build_rank(setup, self.device, progress=progress)
        self.model, self.pool, self.backend, self.runner = parts.model, parts.pool, parts.backend, parts.runner
        if self._group is not None:
            self._group.wait_loaded()
        centring = centre_keys(parts, setup, self.device)
        graph_bytes = capture_graphs(self.runner, config)
        if self._group is not None:
            self._group.wait_ready()
        self.model_config: ModelConfig = self.model.config
        self.kv_capacity_tokens = self.pool.capacity_tokens
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.tokenizer)
        # Structured output: compiled grammars by spec (thread-safe: the server compiles ahead) and
        # the step's bitmask buffer. Nothing of xgrammar loads until a constrained request comes.
        self.grammars = GrammarCache(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        self._bitmasks = BitmaskFiller(self.model.config.vocab_size)
        recurrent = self.cache_spec.has_recurrent_state
        # A reused KV page would need the recurrent state at its end, which is not kept: no prefix reuse.
        self.prefix_caching = config.enable_prefix_caching and not recurrent
        self.block_manager = BlockManager(self.plan.num_pages, PAGE_SIZE, self.prefix_caching,
                                          num_state_slots=config.max_num_seqs if self.cache_spec.needs_slots else 0,
                                          slots_allow_prefix=not recurrent)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=self.plan.max_num_batched_tokens)

        free_after = None
        if self.device.type == "cuda":
            free_after = device_memory(self.device, config.memory_limit_gib).free
        self.plan = self.plan.with_observed(graph_bytes=graph_bytes, free_after_startup=free_after)
        self.startup_lines: list[str] = [self.model.describe(), *self.pool.geometry_lines(), centring,
                                         self.plan.capacity_line(),
                                         "kernels: " + self.backend.kernel_paths(),
                                         f"engine: device={self.device} backend={self.backend.name} "
                                         f"max_context={self.max_context} max_num_seqs={config.max_num_seqs} "
                                         f"max_num_batched_tokens={self.plan.max_num_batched_tokens} "
                                         f"prefix_reuse={int(self.prefix_caching)} "
                                         f"cuda_graphs={int(self.runner.forward_fn != self.runner.eager_forward)}"
                                         + host]
        if self._group is not None:
            self.startup_lines.append(f"tensor parallel: {self.tp_size} ranks, backend={self._group.backend}, "
                                      f"devices={','.join(str(d) for d in devices)}")
        if recurrent and config.enable_prefix_caching:
            self.startup_lines.append("prefix reuse: off (the model has recurrent layers: a reused KV page would "
                                      "need the recurrent state at its end, which is not kept)")
        for line in self.startup_lines:
            log.info("%s", line)

    def shutdown(self) -> None:
        """End the follower ranks (tensor parallelism); nothing to do for a single-process engine.
        Also runs when the engine is garbage-collected or the interpreter exits."""
        if self._group is not None:
            self._group.close()   # kept: a later step raises instead of running on one rank

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params if params is not None else SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"a text prompt needs a tokenizer, and {self.model_dir} has no tokenizer files; "
                                 "pass token ids, or copy the model's tokenizer files into that directory")
            text: str | None = prompt
            ids = list(self.tokenizer.encode(prompt))
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        room = self.max_context - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens < 1 or len(ids) + max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                             f"exceeds max_context={self.max_context}; shorten the prompt or lower max_tokens "
                             f"(at most {max(room, 0)} here)")
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else self._seed_rng.getrandbits(63))
        detok = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output)
        req = Request(request_id, ids, params, max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                      generator=gen, detokenizer=detok, prompt=text)
        if params.structured is not None:   # compiled already when the server sent it (a cache hit)
            req.grammar = GrammarState(self.grammars.compile(params.structured))
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request (unknown or finished ids are ignored: None); its pages return at once.
        Returns its final output (finish_reason "abort"), for a caller that still has a reader."""
        req = self.scheduler.abort(request_id)
        return req.make_output() if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        self.num_steps += 1
        t0 = time.perf_counter()
        group = self._group
        if group is not None:   # the followers run the same step: same pages, same collectives
            group.check()
            group.send("step", self._encoder.encode(batch))
        try:
            idx, logits = self.runner.execute(batch)
        except ValueError as e:
            # The KV formats refuse NaN/Inf K/V with ValueError: fail this batch's requests, keep serving.
            return self._fail_batch(batch.requests, f"step failed: {e}")
        except Exception as e:
            # A collective broken by a follower's death: report the follower, not the collective.
            if group is not None and (down := group.step_failed(e)) is not None:
                raise down from e
            raise
        self.scheduler.after_step(batch)
        if logits is None:
            self.scheduler.observe_step(batch, time.perf_counter() - t0)
            return []
        reqs = [batch.requests[i] for i in idx]
        with torch.inference_mode():  # logits are inference tensors; a hook may edit them in place
            if self.logits_hook is not None:
                self.logits_hook(reqs, logits)
            constrained = [j for j, r in enumerate(reqs) if r.grammar is not None]
            mask = self._bitmasks.fill([reqs[j].grammar for j in constrained]) if constrained else None
            result = sample(logits, [self._sample_row(r) for r in reqs], mask, constrained)
        self.scheduler.observe_step(batch, time.perf_counter() - t0)
        outputs: list[RequestOutput] = []
        bad = set(result.bad_rows)
        for j, req in enumerate(reqs):
            if j in bad:
                req.finish("error", error=f"non-finite logits (NaN/Inf) at position {req.num_tokens} of request "
                                          f"{req.request_id}; the model or its KV cache produced garbage")
                log.error("%s", req.error)
            else:
                if req.num_output_tokens == 0:
                    self.prompt_tokens_total += req.num_prompt_tokens
                self.generation_tokens_total += 1
                req.append_token(result.token_ids[j], result.logprobs[j],
                                 result.top_logprobs[j] if result.top_logprobs else None)
                if req.grammar is not None and not req.grammar.accept(result.token_ids[j]):
                    req.finish("error", error=f"token {result.token_ids[j]} rejected by the grammar of {req.request_id}")
                else:
                    self._check_stop(req, result.token_ids[j])
                    if req.grammar is not None and req.grammar.terminated and not req.is_finished:
                        req.finish("stop")   # the grammar ended with its stop token (ignore_eos)
            outputs.append(req.make_output())
            if req.is_finished:
                self.scheduler.finish(req)
        return outputs

    def _fail_batch(self, reqs: list[Request], message: str) -> list[RequestOutput]:
        log.error("%s (failing %d request(s): %s)", message, len(reqs), ", ".join(r.request_id for r in reqs))
        outputs = []
        for req in reqs:
            req.finish("error", error=message)
            outputs.append(req.make_output())
            self.scheduler.finish(req)   # unpublished pages go back; published ones were computed earlier
        return outputs

    def _sample_row(self, req: Request) -> SampleRow:
        p = req.params
        banned: list[int] = []
        if req.num_output_tokens < p.min_tokens and req.grammar is None:   # a grammar decides its own end
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(req.eos_token_ids))
        # Only the penalties read the output ids: skip copying them (O(output) per step) otherwise.
        return SampleRow(p, req.generator, req.prompt_token_ids, req.output_token_ids if p.penalized else [], banned)

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        past_min = req.num_output_tokens >= p.min_tokens
        if past_min and not p.ignore_eos and tok in req.eos_token_ids:
            req.finish("stop")   # the EOS id stays in token_ids; its text is not produced
            return
        if past_min and tok in p.stop_token_ids:
            req.finish("stop", stop_reason=tok)
            return
        stop_str = req.detokenizer.add_token(tok, check_stop=past_min) if req.detokenizer else None
        if stop_str is not None:
            req.finish("stop", stop_reason=stop_str)
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_context:
            req.finish("length")

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage, kv_capacity_tokens=self.kv_capacity_tokens,
            num_total_pages=bm.num_pages, num_free_pages=bm.num_free_pages,
            prefix_cache_queries=self.scheduler.prefix_queries, prefix_cache_hits=self.scheduler.prefix_hits,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            **({"num_total_state_slots": bm.num_state_slots, "num_free_state_slots": bm.num_free_slots}
               if bm.num_state_slots else {}))

    def get_tokenizer(self) -> Any:
        return self.tokenizer
