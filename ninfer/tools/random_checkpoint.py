"""Random-weight bf16 checkpoints of real geometries, written fast enough to make on the GPU machine.

    python -m ninfer.tools.random_checkpoint --preset qwen3-8b --out /tmp/qwen3-8b-random
    python -m ninfer.tools.random_checkpoint --preset seed-d256 --out /tmp/seed-d256-random
    python -m ninfer.tools.random_checkpoint --preset seed-hybrid --out /tmp/seed-hybrid-random
    python -m ninfer.tools.random_checkpoint --preset qwen3-8b --set num_hidden_layers=2 --device cpu --out DIR
    python -m ninfer.tools.random_checkpoint --preset qwen3-8b --quant fp8 --out /tmp/qwen3-8b-fp8   # or nvfp4

No transformers model is instantiated: every tensor is drawn with torch.randn on the device, copied
to the host and appended to its safetensors shard, one at a time, so host memory stays at one
tensor and an 8B checkpoint takes about as long as the disk needs to take 16 GB. The directory is a
plain HF Qwen3ForCausalLM checkpoint (Qwen3_5ForCausalLM for the hybrid presets): config.json,
model-0000x-of-0000n.safetensors + model.safetensors.index.json, generation_config.json and a tokenizer.

Weights: N(0, std^2) with std 0.02 for every matrix (an 8B model's initializer range), every norm
weight 1 (Qwen3.5's offset norms 0, i.e. a scale of 1; its GDN decay A_log 0). With unit-RMS
normed inputs a projection's output has std 0.02*sqrt(fan_in) (~1.3 at hidden 4096), so the
residual stream grows only additively over the layers and bf16 stays finite.
Speed runs feed token ids and ignore EOS, so the tokenizer only has to load: it is copied from the
bundled probe model when that exists, else a byte-level tokenizer (256 byte tokens + ChatML
specials) is written; config vocab_size is always >= its size.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from ninfer import dtypes
from ninfer.config import DEFAULT_MODEL_DIR
from ninfer.quant import writer

GiB = 1 << 30
# Qwen3-8B's geometry (its max_position raised so 1M-token sweeps run without a rope warning).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
                     max_position_embeddings=1 << 22),
    # Dense stand-in for the seed model's attention: 24 q / 4 kv heads of D256. 16 layers = the seed's
    # 16 full-attention layers, so KV bytes/token equal the seed's (33,792 int8, 17,408 rk4v4-e8);
    # hidden / intermediate / vocab as the seed's 27B (its linear-attention layers are left out).
    "seed-d256": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=16, num_attention_heads=24,
                      num_key_value_heads=4, head_dim=256, vocab_size=248320, rope_theta=10_000_000.0,
                      max_position_embeddings=1 << 22),
    # The seed model: Qwen3.5-27B's geometry (Qwen/Qwen3.5-27B config.json), 64 layers of which every
    # 4th is gated full attention (16 KV layers, as seed-d256) and 48 are Gated DeltaNet.
    "seed-hybrid": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                        rope_theta=10_000_000.0, partial_rotary_factor=0.25, full_attention_interval=4,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=1 << 22),
    # The same layer kinds at CPU-test size (two periods of 3 GDN + 1 attention layer).
    "tiny-hybrid": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=512,
                        rope_theta=10_000_000.0, partial_rotary_factor=0.25, full_attention_interval=4,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=1 << 22),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "vocab.json", "merges.txt", "added_tokens.json")
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def geometry(preset: str | dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A preset's geometry (or a custom dict of HF config fields) with overrides applied."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)} (or pass a dict)")
        g = dict(PRESETS[preset])
    else:
        g = dict(preset)
    g.update(overrides)
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size")
    missing = [k for k in need if k not in g]
    if missing:
        raise ValueError(f"geometry lacks {missing}")
    if g["num_attention_heads"] % g["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    g.setdefault("rope_theta", 1_000_000.0)
    g.setdefault("max_position_embeddings", 1 << 22)
    g.setdefault("tie_word_embeddings", False)
    return g


def is_hybrid(g: dict[str, Any]) -> bool:
    return g.get("model_type") == "qwen3_5_text"


def layer_types(g: dict[str, Any]) -> list[str]:
    if not is_hybrid(g):
        return ["full_attention"] * g["num_hidden_layers"]
    every = int(g.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(g["num_hidden_layers"])]


def tensor_specs(g: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], float | None]]:
    """(HF tensor name, shape, fill) of every weight, in file order; fill None = N(0, std^2), else
    that constant. Qwen3ForCausalLM names, or Qwen3_5ForCausalLM's for a hybrid geometry."""
    h, i, d = g["hidden_size"], g["intermediate_size"], g["head_dim"]
    q, kv = g["num_attention_heads"] * d, g["num_key_value_heads"] * d
    hybrid = is_hybrid(g)
    norm = 0.0 if hybrid else 1.0  # Qwen3.5's norms scale by (1 + w)
    yield "model.embed_tokens.weight", (g["vocab_size"], h), None
    for n, kind in enumerate(layer_types(g)):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,), norm
        if kind == "linear_attention":
            kd = g["linear_num_key_heads"] * g["linear_key_head_dim"]
            hv = g["linear_num_value_heads"]
            vd = hv * g["linear_value_head_dim"]
            a = p + "linear_attn."
            yield a + "in_proj_qkv.weight", (2 * kd + vd, h), None
            yield a + "in_proj_z.weight", (vd, h), None
            yield a + "in_proj_b.weight", (hv, h), None
            yield a + "in_proj_a.weight", (hv, h), None
            yield a + "conv1d.weight", (2 * kd + vd, 1, g["linear_conv_kernel_dim"]), None
            yield a + "dt_bias", (hv,), 1.0
            yield a + "A_log", (hv,), 0.0
            yield a + "norm.weight", (g["linear_value_head_dim"],), 1.0
            yield a + "out_proj.weight", (h, vd), None
        else:
            yield p + "self_attn.q_proj.weight", (2 * q if hybrid else q, h), None
            yield p + "self_attn.k_proj.weight", (kv, h), None
            yield p + "self_attn.v_proj.weight", (kv, h), None
            yield p + "self_attn.o_proj.weight", (h, q), None
            yield p + "self_attn.q_norm.weight", (d,), norm
            yield p + "self_attn.k_norm.weight", (d,), norm
        yield p + "post_attention_layernorm.weight", (h,), norm
        yield p + "mlp.gate_proj.weight", (i, h), None
        yield p + "mlp.up_proj.weight", (i, h), None
        yield p + "mlp.down_proj.weight", (h, i), None
    yield "model.norm.weight", (h,), norm
    if not g["tie_word_embeddings"]:
        yield "lm_head.weight", (g["vocab_size"], h), None


def _layout(spec: tuple[str, tuple[int, ...], float | None], dtype: torch.dtype,
            qc: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors written for one spec: itself, or its quantized form (ninfer/quant/writer.py)."""
    name, shape, fill = spec
    if qc is not None and fill is None and writer.is_quantized(qc, name, shape):
        return writer.tensor_layout(qc, name, shape)
    return [(name, dtype, shape)]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _shards(specs: list[tuple[str, tuple[int, ...], float | None]], dtype: torch.dtype, shard_bytes: int,
            qc: Any = None) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        n = sum(_nbytes(shp, dt) for _, dt, shp in _layout(spec, dtype, qc))
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def _write_shard(path: Path, specs: list, dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                 std: float, qc: Any = None) -> int:
    """The safetensors layout (8-byte header length, JSON header, raw little-endian data), written
    header first and then tensor by tensor as each is drawn on the device (and quantized there)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for spec in specs:
        for name, dt, shape in _layout(spec, dtype, qc):
            n = _nbytes(shape, dt)
            header[name] = {"dtype": writer.safetensors_tag(dt), "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec in specs:
            name, shape, fill = spec
            if fill is not None:
                t = torch.full(shape, fill, dtype=dtype, device=device)
            else:
                t = torch.randn(shape, generator=gen, dtype=torch.float32, device=device).mul_(std).to(dtype)
            parts = writer.quantize(qc, t) if len(_layout(spec, dtype, qc)) > 1 else [t]
            for part in parts:
                f.write(part.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t, parts
    return off


def _byte_level_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=_CHATML, model_max_length=1 << 22)


def write_tokenizer(out: Path, source: str | Path | None = "auto") -> Any:
    """Copy the tokenizer files of `source` ("auto" = the bundled probe model when it has one) into
    out, or write the byte-level tokenizer; returns the loaded tokenizer."""
    from transformers import AutoTokenizer
    if source == "auto":
        source = DEFAULT_MODEL_DIR if (DEFAULT_MODEL_DIR / "tokenizer.json").is_file() else None
    if source is None:
        _byte_level_tokenizer().save_pretrained(out)
    else:
        src = Path(source)
        copied = [shutil.copy2(src / n, out / n) for n in _TOKENIZER_FILES if (src / n).is_file()]
        if not copied:
            raise FileNotFoundError(f"no tokenizer files in {src}")
    return AutoTokenizer.from_pretrained(str(out), local_files_only=True)


def write_random_checkpoint(out_dir: str | Path, preset: str | dict[str, Any] = "qwen3-8b", *,
                            dtype: str | torch.dtype = "bf16", device: str = "auto", seed: int = 0,
                            std: float = 0.02, shard_bytes: int = 4 * GiB, tokenizer: str | Path | None = "auto",
                            overrides: dict[str, Any] | None = None, progress: bool = False,
                            config_only: bool = False, quant: str | None = None) -> Path:
    """Write a random-weight Qwen3ForCausalLM checkpoint (Qwen3_5ForCausalLM for the hybrid presets)
    of `preset` (a name in PRESETS or a dict of HF config fields) to out_dir and return it.
    `overrides` replace geometry fields; `config_only` writes no weights (enough for `ninfer plan`);
    `quant` (fp8, nvfp4, nvfp4-modelopt) writes the linears quantized from the same random weights."""
    g = geometry(preset, **(overrides or {}))
    qc = writer.quant_config(quant) if quant else None
    tdtype = dtypes.to_torch(dtype)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json", out / "hf_quant_config.json"]:
        old.unlink(missing_ok=True)  # a rewrite with fewer shards must not leave stale ones behind
    tok = write_tokenizer(out, tokenizer)
    if g["vocab_size"] < len(tok) and tokenizer == "auto":  # a tiny preset: the probe's vocabulary does not fit
        for n in _TOKENIZER_FILES:
            (out / n).unlink(missing_ok=True)
        tok = write_tokenizer(out, None)
    if g["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size={g['vocab_size']} is smaller than the tokenizer's {len(tok)} tokens")
    gen = torch.Generator(device=dev).manual_seed(seed)
    specs = list(tensor_specs(g))
    shards = _shards(specs, tdtype, shard_bytes, qc)
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.perf_counter()
    for k, shard in enumerate([] if config_only else shards):  # config_only: for `ninfer plan`
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(out / fname, shard, tdtype, dev, gen, std, qc)
        weight_map.update({name: fname for spec in shard for name, _, _ in _layout(spec, tdtype, qc)})
        if progress:
            print(f"  {fname}: {total / GiB:.2f} GiB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if not config_only:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    dname = str(tdtype).removeprefix("torch.")  # config.json spells it "bfloat16"
    hybrid = {}
    if is_hybrid(g):
        hybrid = {k: g[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                    "linear_value_head_dim", "linear_conv_kernel_dim")}
        hybrid["full_attention_interval"] = int(g.get("full_attention_interval", 4))
    config = {
        "architectures": ["Qwen3_5ForCausalLM" if hybrid else "Qwen3ForCausalLM"],
        "model_type": "qwen3_5_text" if hybrid else "qwen3", "hidden_act": "silu", **hybrid,
        **{k: g[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                             "rope_theta", "tie_word_embeddings")},
        "rope_parameters": {"rope_type": "default", "rope_theta": g["rope_theta"],
                            **({"partial_rotary_factor": g["partial_rotary_factor"]} if "partial_rotary_factor" in g
                               else {})},
        "layer_types": layer_types(g), "use_sliding_window": False,
        "sliding_window": None, "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": std, "use_cache": True, "torch_dtype": dname, "dtype": dname, **ids,
        "ninfer_random_checkpoint": {"seed": seed, "std": std, "preset": preset if isinstance(preset, str) else "custom",
                                     "quant": quant},
        **({"quantization_config": writer.quantization_config(quant)} if quant else {}),
    }
    if quant == "nvfp4-modelopt":  # ModelOpt's exporter writes its own file beside config.json
        mo = {k: v for k, v in config["quantization_config"].items() if k != "quant_method"}
        (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": mo},
                                                             indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in ids.items() if v is not None}) + "\n")
    if progress:
        what = "config only" if config_only else f"{len(specs)} tensors, {total / GiB:.2f} GiB, {len(shards)} shard(s)"
        print(f"wrote {out}: {what}, {time.perf_counter() - t0:.1f} s on {dev}", file=sys.stderr)
    return out


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set wants key=value, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ninfer.tools.random_checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--set", dest="overrides", type=_override, action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. num_hidden_layers=4 (repeatable)")
    p.add_argument("--dtype", default="bf16", choices=sorted(dtypes.ALIASES))
    p.add_argument("--device", default="auto", help="where the weights are drawn: auto, cuda, cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-only", action="store_true", help="write config.json and the tokenizer, no weights "
                   "(enough for `ninfer plan`)")
    p.add_argument("--quant", choices=writer.QUANT_KINDS, default=None,
                   help="write the linears quantized: fp8 (HF, 128x128 blocks), fp8-ct (compressed-tensors "
                        "FP8_BLOCK), nvfp4 (compressed-tensors), nvfp4-modelopt; lm_head and GDN in_proj_a/b stay "
                        "in --dtype")
    p.add_argument("--std", type=float, default=0.02)
    p.add_argument("--shard-gib", type=float, default=4.0)
    p.add_argument("--tokenizer-from", default="auto",
                   help="directory whose tokenizer files are copied; auto = the probe model's if present; "
                        "'byte' = a byte-level tokenizer")
    a = p.parse_args(argv)
    try:
        _write_from_args(a)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"random_checkpoint: {e}") from None
    return 0


def _write_from_args(a: argparse.Namespace) -> None:
    write_random_checkpoint(a.out, a.preset, dtype=a.dtype, device=a.device, seed=a.seed, std=a.std,
                            shard_bytes=int(a.shard_gib * GiB), overrides=dict(a.overrides), progress=True,
                            config_only=a.config_only, quant=a.quant,
                            tokenizer=None if a.tokenizer_from == "byte" else a.tokenizer_from)


if __name__ == "__main__":
    sys.exit(main())
