"""Offline API, vLLM-shaped: `LLM(model_dir, kv_dtype=..., device=..., max_context=...)` and
`LLM.generate(prompts_or_token_ids, SamplingParams(...)) -> list[RequestOutput]` in prompt order."""
from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any, Sequence

from tqdm.auto import tqdm

from ninfer.config import DEFAULT_KV_DTYPE, EngineConfig, parse_token_count
from ninfer.engine.engine import LLMEngine
from ninfer.engine.request import RequestOutput
from ninfer.engine.sampling import SamplingParams

# vLLM keyword spellings accepted by LLM(...)
_ALIASES = {"max_model_len": "max_context", "kv_cache_dtype": "kv_dtype",
            "max_concurrency": "max_num_seqs", "memory_limit": "memory_limit_gib"}

Prompt = str | list[int]


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


class LLM:
    def __init__(self, model: str | None = None, kv_dtype: str = DEFAULT_KV_DTYPE, device: str = "auto",
                 max_context: int | str | None = None, *, progress: bool = False, **kwargs: Any) -> None:
        names = {f.name for f in fields(EngineConfig)}
        cfg: dict[str, Any] = {}
        for key, value in kwargs.items():
            key = _ALIASES.get(key, key)
            if key not in names:
                raise TypeError(f"LLM() got an unexpected keyword {key!r}; engine options: {', '.join(sorted(names))}")
            cfg[key] = value
        if isinstance(cfg.get("kv_capacity"), str) and cfg["kv_capacity"] != "auto":
            cfg["kv_capacity"] = parse_token_count(cfg["kv_capacity"])
        if max_context is not None:
            max_context = parse_token_count(max_context)
        self.engine = LLMEngine(EngineConfig(model=model, kv_dtype=kv_dtype, device=device,
                                             max_context=max_context, **cfg), progress=progress)
        self._ids = itertools.count()

    def close(self) -> None:
        """End the engine's follower ranks now (tensor parallelism); otherwise when it is collected."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def startup_lines(self) -> list[str]:
        return self.engine.startup_lines

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (one prompt, or a list of them); one
        SamplingParams for all or one per prompt. Returns the final output of each, in order."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        order: dict[str, int] = {}
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p)
                order[rid] = len(order)
            results: list[RequestOutput | None] = [None] * len(prompts)
            bar = tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
            prompt_toks = gen_toks = 0
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id not in order:
                        continue
                    gen_toks += len(out.new_token_ids)
                    if out.finished:
                        results[order[out.request_id]] = out
                        prompt_toks += len(out.prompt_token_ids)
                        bar.update(1)
                rate = bar.format_dict.get("elapsed") or 0.0
                if rate > 0:
                    bar.set_postfix_str(f"in {prompt_toks / rate:.0f} tok/s, out {gen_toks / rate:.0f} tok/s", refresh=False)
            bar.close()
        except BaseException:
            for rid in order:  # leave the engine clean for the next call
                self.engine.abort_request(rid)
            raise
        return [r for r in results if r is not None]
