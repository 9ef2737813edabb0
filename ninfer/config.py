"""Engine configuration: one frozen dataclass, the CLI flags that fill it (seed-engine names with
the vLLM spellings as aliases), and the parsing of human token counts (binary units whatever the
case: "32k" = "32K" = 32768, "1m" = "1M" = 1048576, as context sizes are counted)."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_KV_DTYPE = "rk4v4-e8"
# the bundled probe model (models/probe/ in the repository): the model used when none is named
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "probe"
PAGE_SIZE = 64


def parse_token_count(text: str | int) -> int:
    """'32k' = '32K' -> 32768, '1m' = '1M' -> 2**20, '1g' = '1G' -> 2**30, '4096' -> 4096."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (examples: 4096, 32k, 128K)")
    value, unit = float(m.group(1)), m.group(2)
    mult = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit.lower()]
    n = int(value * mult)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"token count must be positive: {text!r}")
    return n


def _capacity(text: str) -> int | str:
    return "auto" if str(text).strip().lower() == "auto" else parse_token_count(text)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return v


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None                 # model dir; None = the bundled probe model
    kv_dtype: str = DEFAULT_KV_DTYPE
    max_context: int | None = None           # None = the model's max_position_embeddings (after rope scaling)
    kv_capacity: int | str = "auto"          # tokens, or "auto" = all memory left after headroom
    memory_limit_gib: float | None = None    # plan as if the device had only this much
    dtype: str = "auto"                      # weights/activations: auto (config's), bf16, fp16, fp32
    device: str = "auto"                     # auto = cuda if available else cpu
    enforce_eager: bool = False              # no CUDA graphs
    enable_prefix_caching: bool = True
    kv_centering: bool | None = None         # exact key centring before quantization; None = on for quantized KV
    max_num_seqs: int = 64                   # --max-concurrency
    max_num_batched_tokens: int | str = "auto"  # token budget per step = largest prefill chunk; auto: the planner's
    rope_yarn_factor: float | None = None
    rope_original_max_position: int | None = None
    seed: int = 0
    threads: int | None = None               # CPU intra-op threads; None = OMP_NUM_THREADS or physical cores
    tensor_parallel_size: int = 1            # ranks (processes), one per GPU; gloo on CPU

    def replace(self, **kw) -> "EngineConfig":
        return EngineConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **kw})


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default=None,
                       help="HF model directory, .gguf file, or alias smollm2 (default: the bundled probe model)")
    g = p.add_argument_group("engine")
    g.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default=DEFAULT_KV_DTYPE,
                   help="KV cache format: auto, bf16, int8, rk4v4, rk4v4-e8 (default %(default)s)")
    g.add_argument("--max-context", "--max-model-len", dest="max_context", type=parse_token_count, default=None,
                   help="longest prompt+output a request may have (e.g. 128K)")
    g.add_argument("--kv-capacity", dest="kv_capacity", type=_capacity, default="auto",
                   help="KV pool size in tokens, or auto (default): on a GPU all memory left after headroom, on CPU "
                        "room for max-context x min(max-concurrency, 4) tokens")
    g.add_argument("--memory-limit", dest="memory_limit_gib", type=_positive_float, default=None, metavar="GiB",
                   help="plan as if the device had only this much memory")
    g.add_argument("--dtype", default="auto", choices=["auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"],
                   help="weights/activations dtype (default auto: the config's; on a CPU without native bf16, fp32)")
    g.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    g.add_argument("--no-cuda-graph", "--enforce-eager", dest="enforce_eager", action="store_true",
                   help="run decode eagerly (no CUDA graphs)")
    g.add_argument("--no-prefix-reuse", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="never reuse cached KV pages of a shared prompt prefix")
    g.add_argument("--no-kv-centering", dest="kv_centering", action="store_const", const=False, default=None,
                   help="store keys as they are (default: centred and smoothed, exactly, for quantized KV formats)")
    g.add_argument("--max-concurrency", "--max-num-seqs", dest="max_num_seqs", type=int, default=64,
                   help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", "--prefill-chunk", dest="max_num_batched_tokens",
                   type=_capacity, default="auto",
                   help="token budget per step (largest prefill chunk), or auto (default): on a GPU the largest of "
                        "32K/16K/8K whose activation workspace costs at most 2%% of the KV pool; 8K on CPU")
    g.add_argument("--rope-yarn-factor", dest="rope_yarn_factor", type=_positive_float, default=None,
                   help="extend the context with YaRN by this factor")
    g.add_argument("--rope-original-max-position", dest="rope_original_max_position", type=parse_token_count,
                   default=None, help="the pre-YaRN window (default: the config's max_position_embeddings)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without a sampling seed")
    g.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=_positive_int, default=1,
                   metavar="N", help="shard the model over N processes, one GPU each (cuda:i..cuda:i+N-1 for "
                                     "--device cuda:i; on CPU N processes over gloo); default 1")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads (default: OMP_NUM_THREADS if set, else the physical cores that are not busy)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
