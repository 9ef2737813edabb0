"""GGUF checkpoints (llama.cpp's single-file format) as HF-style directories.

`convert_cached(path)` reads the file with the `gguf` package, dequantizes every tensor
(`gguf.quants.dequantize`, vectorised numpy), maps llama.cpp tensor names back to HF names,
undoes llama.cpp's Q/K row permutation for the `llama` architecture (its converter reorders each
head's rows from HF's half-split rotary layout to interleaved pairs), builds the tokenizer and chat
template from the metadata, and writes config.json + model.safetensors + tokenizer files +
generation_config.json under ~/.cache/ninfer/gguf/<key>/ (NINFER_CACHE_DIR or XDG_CACHE_HOME move
it), key = sha256 of the resolved path, size and mtime. Later loads read that directory only.
Weights are stored as fp16 (GGUF's block scales are fp16, so little is lost)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ninfer.checkpoints")

ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
         "qwen3": ("Qwen3ForCausalLM", "qwen3")}
_FLOATS = {"F32", "F16", "BF16", "F64"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
# Pre-tokenizer split patterns by tokenizer.ggml.pre (llama.cpp's names), applied before byte-level BPE.
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE = {"gpt2": [_GPT2], "default": [_GPT2], "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2],
        "llama-bpe": [_LLAMA3], "llama3": [_LLAMA3], "qwen2": [_QWEN2]}
FORMAT_VERSION = 1  # bump when the converted layout changes, so old cache entries are not reused


class GGUFError(ValueError):
    """A .gguf file this converter cannot turn into a checkpoint (one-line message)."""


def cache_root() -> Path:
    if os.environ.get("NINFER_CACHE_DIR"):
        return Path(os.environ["NINFER_CACHE_DIR"]) / "gguf"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ninfer" / "gguf"


def cache_key(path: Path) -> str:
    st = path.stat()
    text = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{FORMAT_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def convert_cached(path: str | Path, *, progress: bool = False) -> Path:
    """The converted directory of `path`, converting it first when no cached copy exists."""
    path = Path(path)
    out = cache_root() / cache_key(path)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        t0 = time.monotonic()
        convert(path, tmp, progress=progress)
        try:
            tmp.rename(out)  # atomic: a reader never sees a half-written directory
        except OSError:      # another process converted it meanwhile
            if not (out / "config.json").is_file():
                raise
        log.info("converted %s to %s in %.1fs", path, out, time.monotonic() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _reader(path: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{path}: reading .gguf files needs the gguf package: pip install gguf") from None

    class Reader(GGUFReader):
        def __setattr__(self, key: str, value: Any) -> None:
            # Plain ndarray views of the map: np.memmap's per-slice bookkeeping is half the parse time
            # of a vocabulary's ~100K metadata strings. The view keeps the map alive.
            if key == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)
            super().__setattr__(key, value)

    try:
        return Reader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on a bad magic or a cut file
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None


def metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string fields (token arrays excluded: they are read where needed)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "merges", "token_type", "scores"):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # an exotic field type we do not need
            pass
    return out


def _array(reader: Any, key: str) -> list[Any] | None:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def hf_config(meta: dict[str, Any], tensor_names: set[str], vocab: int, path: Path) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{path}: rope scaling {scaling if scaling != 'none' else 'rope_freqs'} in a GGUF file "
                        "is not supported; use the HF checkpoint of this model")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    name, model_type = ARCHS[arch]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": [name], "model_type": model_type, "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": vocab, "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos,
    }


def hf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in _LAYER:
        raise GGUFError(f"GGUF tensor {name!r} has no HF counterpart in the supported architectures")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute(w: "torch.Tensor", n_head: int) -> "torch.Tensor":
    """Inverse of llama.cpp's per-head reordering: rows (pair, 2) back to (2, half)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(data: np.ndarray, kind: Any) -> "torch.Tensor":
    """float32 values of one GGUF tensor's raw blocks (gguf.quants: vectorised numpy; measured
    faster here than a torch version of the same block arithmetic)."""
    import torch
    from gguf.quants import dequantize as np_dequantize
    return torch.from_numpy(np.array(np_dequantize(data, kind), dtype=np.float32))  # a copy: F32 data is the map


def tensors(reader: Any, cfg: dict[str, Any], path: Path, progress: bool = False) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    import gguf.quants

    # What gguf.quants dequantizes (its numpy block codecs), checked for every tensor before any work.
    supported = _FLOATS | {k.name for k in getattr(gguf.quants, "_type_traits", {})}
    for t in reader.tensors:
        if t.tensor_type.name not in supported:
            raise GGUFError(f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which this converter cannot "
                            f"dequantize; supported: {', '.join(sorted(supported))}")
    out = {}
    permute = cfg["model_type"] == "llama"
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress, leave=False):
        # GGUF lists dims fastest-first; the data is row-major [out, in].
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape.tolist())])
        if permute and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute(w, cfg["num_attention_heads"])
        elif permute and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute(w, cfg["num_key_value_heads"])
        out[hf_name(t.name)] = w.to(torch.float16).contiguous()
    return out


def tokenizer(reader: Any, meta: dict[str, Any], path: Path) -> Any:
    """A transformers fast tokenizer from the file's byte-level BPE vocabulary and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _PRE:
        raise GGUFError(f"{path}: tokenizer {kind!r} (pre-tokenizer {pre!r}) is not supported; supported: "
                        f"byte-level BPE (gpt2) with pre-tokenizer {', '.join(sorted(_PRE))}")
    tokens = [str(t) for t in _array(reader, "tokenizer.ggml.tokens")]
    merges = [tuple(str(m).split(" ", 1)) for m in (_array(reader, "tokenizer.ggml.merges") or [])]
    types = _array(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    split = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in _PRE[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(split + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # llama.cpp token types: 3 = control (special), 4 = user-defined (added, not special)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special("bos"), eos_token=special("eos"),
                                   unk_token=special("unknown"), pad_token=special("padding"))
    if meta.get("tokenizer.ggml.add_bos_token") and fast.bos_token:
        from tokenizers import processors
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fast.bos_token} $A", pair=f"{fast.bos_token} $A {fast.bos_token} $B",
            special_tokens=[(fast.bos_token, fast.bos_token_id)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=fast.bos_token, eos_token=fast.eos_token,
                                       unk_token=fast.unk_token, pad_token=fast.pad_token)
    if meta.get("tokenizer.chat_template"):
        fast.chat_template = str(meta["tokenizer.chat_template"])
    return fast


def convert(path: Path, out: Path, *, progress: bool = False) -> None:
    from safetensors.torch import save_file

    reader = _reader(path)
    meta = metadata(reader)
    names = {t.name for t in reader.tensors}
    tokens = _array(reader, "tokenizer.ggml.tokens")
    arch = meta.get("general.architecture")
    vocab = int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    cfg = hf_config(meta, names, vocab, path)
    tok = tokenizer(reader, meta, path)   # before the weights: a refused tokenizer fails fast
    weights = tensors(reader, cfg, path, progress=progress)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    tok.save_pretrained(str(out))
