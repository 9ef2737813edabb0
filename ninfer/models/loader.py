"""Load an HF checkpoint directory (config.json + one or sharded *.safetensors) into our decoder,
and its tokenizer. Every failure names the file and the tensor: a missing shard, a truncated or
unreadable file, a missing tensor, a shape that does not fit the config."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ninfer import dtypes, quant
from ninfer.layers.rotary import apply_rope_overrides
from ninfer.model_config import ModelConfig
from ninfer.distributed import parallel_state as ps
from ninfer.layers.tp_geometry import check_tensor_parallel
from ninfer.models.base import CausalLM, Target
from ninfer.models.registry import get_model_class

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory whose weights cannot be loaded as the config describes."""


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    """'auto' = the config's torch_dtype; else bf16/fp16/fp32 (or a torch.dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if name not in dtypes.ALIASES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, bf16, fp16 or fp32")
    return dtypes.to_torch(name)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def checkpoint_files(model_dir: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The weight files, and the index's tensor -> file map when the checkpoint is sharded."""
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
        by_tensor = {name: model_dir / fname for name, fname in weight_map.items()}
        files = sorted(set(by_tensor.values()))
        for f in files:
            if not f.is_file():
                users = sorted(n for n, p in by_tensor.items() if p == f)
                raise CheckpointError(f"{index_path} points at {f.name}, which does not exist in {model_dir} "
                                      f"({len(users)} tensors, e.g. {users[0]})")
        return files, by_tensor
    single = model_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    return files, None


def tensor_names(model_dir: Path) -> set[str]:
    """Every tensor name of the checkpoint (the index, or the files' headers)."""
    files, index = checkpoint_files(model_dir)
    if index is not None:
        return set(index)
    names: set[str] = set()
    for path in files:
        with _open(path) as f:
            names.update(f.keys())
    return names


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise CheckpointError(f"cannot read {path}: {e} (truncated or corrupt safetensors file?)") from e


_PACKED_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}  # safetensors names of packed weights


def _copy(f: Any, name: str, target: Target, param: torch.Tensor) -> None:
    """Fill `param` from checkpoint tensor `name`: the whole tensor, or only the rows / columns of
    this rank (a rank reads its slices and never the full tensor)."""
    with torch.no_grad():
        if target.pieces is None:
            param.copy_(f.get_tensor(name).reshape(param.shape))  # a scalar scale may be stored [] or [1]
            return
        dim = target.dim
        if len(target.pieces) == 1 and target.pieces[0][0] == 0 and target.pieces[0][2] == target.shape[dim]:
            param.narrow(dim, target.pieces[0][1], target.shape[dim]).copy_(f.get_tensor(name))
            return
        sl = f.get_slice(name)
        for src, dst, n in target.pieces:
            param.narrow(dim, dst, n).copy_(sl[(slice(None),) * dim + (slice(src, src + n),)])


def load_weights(model: CausalLM, model_dir: Path, *, progress: bool = True) -> None:
    """Copy every checkpoint tensor into its parameter (rows of a merged linear, this rank's slice of a
    split one), checking the checkpoint shapes, and fail if any parameter stayed unfilled."""
    files, index = checkpoint_files(model_dir)
    cmap = model.checkpoint_map()
    params = dict(model.named_parameters())
    loaded: dict[str, Path] = {}
    ignored: list[str] = []
    bar = tqdm(total=len(cmap), desc=f"Loading {model_dir.name}", unit="tensor", disable=not progress, leave=False)
    try:
        for path in files:
            with _open(path) as f:
                names = set(f.keys())
                if index is not None:
                    absent = sorted(n for n, p in index.items() if p == path and n not in names)
                    if absent:
                        raise CheckpointError(f"{path}: lacks tensor {absent[0]} which {INDEX_NAME} places there"
                                              + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
                for name in sorted(names):
                    if name not in cmap:
                        ignored.append(name)
                        continue
                    if name in loaded:
                        raise CheckpointError(f"tensor {name} appears in both {loaded[name]} and {path}")
                    target = cmap[name]
                    param = params[target.param]
                    try:
                        header = f.get_slice(name)  # shape and dtype from the header, nothing read yet
                        shape = tuple(header.get_shape())
                        if shape != target.shape and not (math.prod(shape) == 1 == math.prod(target.shape)):
                            raise CheckpointError(
                                f"{path}: tensor {name} has shape {list(shape)}, but the config "
                                f"({model.config.architecture}) needs {list(target.shape)}")
                        stored = _PACKED_DTYPES.get(header.get_dtype())
                        if stored is not None and param.dtype != stored:
                            raise CheckpointError(
                                f"{path}: tensor {name} is {stored} (quantized) but loads into a "
                                f"{param.dtype} weight: its scale tensors are missing, or config.json does "
                                f"not declare the quantization")
                        _copy(f, name, target, param)
                    except CheckpointError:
                        raise
                    except Exception as e:
                        raise CheckpointError(f"{path}: cannot read tensor {name}: {e} "
                                              "(truncated or corrupt safetensors file?)") from e
                    loaded[name] = path
                    bar.update(1)
    finally:
        bar.close()
    missing = [n for n in cmap if n not in loaded]
    if missing:
        where = ", ".join(p.name for p in files)
        raise CheckpointError(f"{model_dir}: missing tensor {missing[0]}" +
                              (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                              f"; looked in {where}")
    # a tied checkpoint may still carry lm_head.weight; HF keeps rotary buffers in old checkpoints
    unexpected = [n for n in ignored if not (n == "lm_head.weight" and model.config.tie_word_embeddings)
                  and not n.endswith("rotary_emb.inv_freq") and not n.startswith(model.checkpoint_ignore)
                  and not n.endswith(quant.UNUSED_SUFFIXES)]
    if unexpected:
        log.warning("%s: ignored %d checkpoint tensors the model does not use, e.g. %s",
                    model_dir, len(unexpected), unexpected[:3])


def _check_sharding(cfg: ModelConfig, model_dir: Path) -> None:
    """Refuse what this process's tensor-parallel group cannot split, before anything is allocated."""
    size = ps.tp_size()
    if size == 1:
        return
    check_tensor_parallel(cfg, size, model_dir.name)
    quant = cfg.raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
        raise CheckpointError(f"{model_dir.name}: {method} weights cannot be split across ranks; "
                              f"tensor-parallel-size {size} needs a bf16/fp16/fp32 checkpoint")


_ROPE_KEYS = ("rope_yarn_factor", "rope_original_max_position")


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               rope_overrides: Mapping[str, Any] | Any | None = None, *, progress: bool = True) -> CausalLM:
    """Build the architecture named by config.json and fill it from the safetensors files.

    rope_overrides: `{"rope_yarn_factor": F, "rope_original_max_position": N}` or any object with
    those attributes (an EngineConfig); None values are ignored. They turn on static YaRN;
    `model.config` then carries the new rope_scaling and `model.max_position` the scaled length."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.load(model_dir)
    if rope_overrides is None or isinstance(rope_overrides, Mapping):
        ro = dict(rope_overrides or {})
        unknown = set(ro) - set(_ROPE_KEYS)
        if unknown:
            raise ValueError(f"unknown rope override(s) {sorted(unknown)}; known: {', '.join(_ROPE_KEYS)}")
    else:
        ro = {k: getattr(rope_overrides, k, None) for k in _ROPE_KEYS}
    cfg = apply_rope_overrides(cfg, ro.get("rope_yarn_factor"), ro.get("rope_original_max_position"))
    model_cls = get_model_class(cfg.architecture)
    _check_sharding(cfg, model_dir)
    torch_dtype = resolve_dtype(dtype, cfg)
    dev = resolve_device(device)
    qc = quant.parse_quant_config(cfg.raw)  # refuses an unsupported scheme before anything is built
    checkpoint_files(model_dir)  # fail on a broken directory before allocating anything
    # Build on the meta device (no random init of big matrices), then allocate for real.
    with torch.device("meta"):
        model = model_cls(cfg).to(dtype=torch_dtype)
        if qc is not None:  # after the cast, which would turn fp8 weights into the activation dtype
            quant.quantize_modules(model, qc, tensor_names(model_dir))
    model = model.to_empty(device=dev)
    model.tie_weights()  # to_empty gives each module its own new tensor; share again
    load_weights(model, model_dir, progress=progress)
    model.eval().requires_grad_(False)
    if qc is not None:
        quant.finalize(model)
    model.place(dev)
    log.info("%s", model.describe())
    if qc is not None:
        log.info("%s", quant.describe(model, qc))
    return model


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's HF tokenizer (with its chat template), from local files only."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot load a tokenizer from {model_dir}: {e}") from e
