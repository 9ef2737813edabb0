"""What every rank builds from the driver's plan: the model (its shard), the KV pool, the attention
backend, the model runner and, on CUDA, the decode graphs. The driver builds the same parts as the
followers, from the same `RankSetup`, so every rank holds the same number of pages."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer.attention.selector import select_backend
from ninfer.config import PAGE_SIZE, EngineConfig
from ninfer.engine.model_runner import ModelRunner
from ninfer.kvcache.formats import get_format
from ninfer.kvcache.planner import MemoryPlan
from ninfer.kvcache.pool import KVCachePool
from ninfer.kvcache.spec import CacheSpec
from ninfer.kvcache import centering
from ninfer.models.loader import load_model, load_tokenizer

log = logging.getLogger("ninfer.engine")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def load_tokenizer_or_none(model_dir: Path) -> Any:
    """The checkpoint's tokenizer, or None when it ships no tokenizer files at all (as vLLM's
    skip_tokenizer_init: prompts must then be token ids and outputs carry ids, no text)."""
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        log.warning("no tokenizer files in %s: prompts must be token ids, and outputs have no text", model_dir)
        return None
    try:
        return load_tokenizer(model_dir)
    except ValueError as e:  # keep the first line: transformers' own text runs on for several
        raise ValueError(str(e).strip().splitlines()[0].rstrip(": ")) from None



@dataclass(frozen=True)
class RankSetup:
    """Everything a rank needs to build its parts (picklable: the driver sends it to the followers)."""
    config: EngineConfig
    model_dir: Path
    dtype: torch.dtype
    max_context: int
    plan: MemoryPlan
    cache_spec: CacheSpec


@dataclass
class RankParts:
    model: torch.nn.Module
    pool: KVCachePool
    backend: object
    runner: ModelRunner
    tokenizer: Any


def build_rank(setup: RankSetup, device: torch.device, *, progress: bool = False) -> RankParts:
    cfg = setup.config
    rope = {"rope_yarn_factor": cfg.rope_yarn_factor, "rope_original_max_position": cfg.rope_original_max_position}
    model = load_model(setup.model_dir, setup.dtype, device, rope, progress=progress)
    if model.cache_specs(get_format(cfg.kv_dtype)) != setup.cache_spec:
        raise RuntimeError("the loaded model declares another cache spec than the one planned")
    pool = KVCachePool.from_plan(setup.plan, device, setup.dtype, spec=setup.cache_spec)
    pool.assert_geometry()  # DESIGN 2.2: packed planes are checked, never assumed
    # Which kernel serves each attention op is decided here, once; an unsupported format is refused.
    backend = select_backend(pool, device, setup.dtype, model.local_heads[0])
    tokenizer = load_tokenizer_or_none(setup.model_dir)
    runner = ModelRunner(model, backend, device=device, page_size=PAGE_SIZE,
                         max_pages_per_seq=-(-setup.max_context // PAGE_SIZE))
    return RankParts(model, pool, backend, runner, tokenizer)


def centre_keys(parts: RankParts, setup: RankSetup, device: torch.device) -> str:
    """Calibrate and install the key centring (ninfer/kvcache/centering.py); returns its startup line.
    Every rank runs it once all ranks have loaded (the calibration forward's collectives run in
    lock-step), and before graph capture: the tensors are static."""
    return centering.setup(parts.model, parts.tokenizer, parts.pool, device, get_format(setup.config.kv_dtype),
                           setup.config.kv_centering)


def capture_graphs(runner: ModelRunner, config: EngineConfig) -> int:
    """Decode CUDA graphs (CUDA and not enforce_eager): `ninfer.engine.cuda_graphs.capture_decode_graphs
    (runner, batch_sizes) -> pool bytes` replaces `runner.forward_fn`. Returns the observed bytes. With
    tensor parallelism every rank captures the same buckets (the all-reduces are captured too)."""
    if runner.device.type != "cuda" or config.enforce_eager:
        return 0
    try:
        from ninfer.engine.cuda_graphs import capture_decode_graphs
    except ImportError as e:
        log.warning("decode CUDA graphs unavailable (%s); running decode eagerly", e)
        return 0
    from ninfer.kvcache.planner import cuda_graph_batch_sizes
    return int(capture_decode_graphs(runner, cuda_graph_batch_sizes(config.max_num_seqs)))


def pool_digest(pool: KVCachePool) -> str:
    """A hash of every byte of the KV pages and recurrent states: ranks that hold the same heads and
    ran the same steps agree on it bit for bit (the lock-step check of the tensor-parallel tests)."""
    import hashlib
    h = hashlib.blake2b(digest_size=16)
    for planes in [*pool.layers, *pool.states]:
        for name in sorted(planes):
            h.update(name.encode())
            h.update(planes[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
