"""Tiny random-weight HF checkpoints for tests, written by transformers itself (the oracle).

    from tests.tiny_models import make_checkpoint
    path = make_checkpoint(tmp_path, arch="qwen3", hidden=64, layers=2, heads=6, kv_heads=1, head_dim=64)

`path` is a directory with config.json, *.safetensors (sharded when shards > 1, with
model.safetensors.index.json), generation_config.json and a small real byte-level BPE tokenizer
(tokenizer.json, ChatML chat template, bos `<s>`, eos `<|im_end|>`, pad `<|endoftext|>`).
Everything is deterministic for given arguments. In tests prefer the session-cached fixtures of
conftest.py (`tiny_checkpoint(**kwargs)`, `tiny_model_dir`)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

ARCHS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
         "mistral": "MistralForCausalLM"}
SPECIAL_TOKENS = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. A needle hides in the haystack; the magic number is 7421. "
    "Long context inference keeps every key and value of the prompt in a paged cache. "
    "Questions: what is the capital of France? Paris. What is two plus two? Four. "
    "def main():\n    print('hello world')\n    return 0\n"
    "0123456789 user assistant system hello world the a an of to in is it you that he was for on are with "
)


def make_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE PreTrainedTokenizerFast trained on a fixed text (encodes any string)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TRAIN_TEXT] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None, chat_template=CHAT_TEMPLATE,
                                   model_max_length=1 << 20)


def _config(arch: str, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
            intermediate: int, rope_scaling: dict | None, rope_theta: float, max_position: int,
            tie: bool, attention_bias: bool, dtype: str, token_ids: dict[str, int], init_std: float) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig}[arch]
    kw: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        initializer_range=init_std, **token_ids)
    if arch in ("qwen3", "llama"):
        kw["attention_bias"] = attention_bias
    if arch == "qwen2":
        del kw["head_dim"]
    if arch == "mistral":
        kw["sliding_window"] = None
    cfg = cls(**kw)
    cfg.architectures = [ARCHS[arch]]
    cfg.dtype = dtype
    return cfg


def make_checkpoint(tmpdir: str | Path, arch: str = "qwen3", hidden: int = 64, layers: int = 2, heads: int = 6,
                    kv_heads: int = 1, head_dim: int = 64, vocab: int | None = None,
                    rope_scaling: dict | None = None, dtype: str = "float32", shards: int = 1, *,
                    intermediate: int | None = None, tie_word_embeddings: bool = False,
                    attention_bias: bool = False, rope_theta: float = 10000.0, max_position: int = 4096,
                    seed: int = 0, init_std: float = 0.1, name: str | None = None) -> Path:
    """Write a random-weight `arch` checkpoint (qwen3 | qwen2 | llama | mistral) under `tmpdir` and
    return its directory.

    vocab: None = the tokenizer's size (rounded up to a multiple of 8); a larger value pads the
    embedding with unused rows. rope_scaling: extra rope keys, e.g. {"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 1024}. dtype: weights dtype on disk ("float32" | "bfloat16" |
    "float16"). shards > 1 splits the weights into about that many files plus an index.
    Weights: transformers' init (std `init_std`; 0.1 rather than HF's 0.02 so attention is far from
    uniform and a RoPE or mask bug moves the logits) with `seed`, then every norm weight and bias perturbed (init leaves
    them at 1/0, which would hide a missing or misplaced norm/bias)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    # transformers' own config validation: Qwen2 has no head_dim field, Llama checks hidden % heads
    if arch == "qwen2" and heads * head_dim != hidden:
        raise ValueError(f"qwen2 derives head_dim = hidden // heads: need heads*head_dim == hidden "
                         f"({heads}*{head_dim} != {hidden})")
    if arch == "llama" and hidden % heads:
        raise ValueError(f"llama needs hidden % heads == 0 ({hidden} % {heads})")
    out = Path(tmpdir) / (name or f"{arch}-h{hidden}-l{layers}-q{heads}-kv{kv_heads}-d{head_dim}-s{shards}")
    tokenizer = make_tokenizer()
    vocab = vocab or 8 * math.ceil(len(tokenizer) / 8)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab={vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    cfg = _config(arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  vocab=vocab, intermediate=intermediate or 2 * hidden, rope_scaling=rope_scaling,
                  rope_theta=rope_theta, max_position=max_position, tie=tie_word_embeddings,
                  attention_bias=attention_bias, dtype=dtype, token_ids=ids, init_std=init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if "norm" in pname else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    kw: dict[str, Any] = {"safe_serialization": True}
    if shards > 1:
        kw["max_shard_size"] = max(1, total // shards + 1)
    model.save_pretrained(out, **kw)
    GenerationConfig(**ids).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_metadata(query_lens: list[int], seq_lens: list[int], page_size: int = 64,
                   first_pages: list[int] | None = None) -> Any:
    """AttentionMetadata for sequences that each own consecutive pages: sequence b owns
    ceil(seq_lens[b] / page_size) pages from first_pages[b] (default: right after sequence b-1's,
    from page 0). Its new tokens are its last query_lens[b] tokens. For tests of models/backends."""
    from ninfer.attention.base import AttentionMetadata

    tables, slots, page = [], [], 0
    for b, (q, n) in enumerate(zip(query_lens, seq_lens)):
        start = first_pages[b] if first_pages is not None else page
        pages = list(range(start, start + -(-n // page_size)))
        page = start + len(pages)
        tables.append(pages)
        slots += [pages[i // page_size] * page_size + i % page_size for i in range(n - q, n)]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), is_decode=all(q == 1 for q in query_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))


def make_hybrid_checkpoint(tmpdir: str | Path, *, hidden: int = 64, layer_types: tuple[str, ...] = ("linear", "full"),
                           heads: int = 4, kv_heads: int = 2, head_dim: int = 128, linear_k_heads: int = 2,
                           linear_v_heads: int = 4, linear_k_dim: int = 32, linear_v_dim: int = 32,
                           conv_kernel: int = 4, partial_rotary: float = 0.25, intermediate: int | None = None,
                           dtype: str = "float32", seed: int = 0, init_std: float = 0.1, vision: bool = False,
                           name: str | None = None) -> Path:
    """A random-weight Qwen3.5 hybrid (`qwen3_5_text`, Qwen3_5ForCausalLM) written by transformers;
    layer_types: "linear" (Gated DeltaNet) / "full" (gated attention) per layer. vision=True writes
    the image-text release instead (Qwen3_5ForConditionalGeneration with a one-block vision tower,
    the text weights under model.language_model.). Norms, biases and dt_bias are perturbed as in
    make_checkpoint (offset norms around 0, the gated GDN norm around 1); A_log keeps its init."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    kinds = {"linear": "linear_attention", "full": "full_attention"}
    tokenizer = make_tokenizer()
    vocab = 8 * math.ceil(len(tokenizer) / 8)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                num_hidden_layers=len(layer_types), num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, linear_num_key_heads=linear_k_heads, linear_num_value_heads=linear_v_heads,
                linear_key_head_dim=linear_k_dim, linear_value_head_dim=linear_v_dim,
                linear_conv_kernel_dim=conv_kernel, layer_types=[kinds[t] for t in layer_types],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": partial_rotary},
                max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=init_std, **ids)
    torch.manual_seed(seed)
    if vision:
        cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                 num_heads=2, out_hidden_size=hidden))
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
        model = Qwen3_5ForConditionalGeneration(cfg)
    else:
        cfg = Qwen3_5TextConfig(**text)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    cfg.dtype = dtype
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 and not pname.endswith("A_log"):
                base = 1.0 if pname.endswith("linear_attn.norm.weight") or pname.endswith("dt_bias") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    tag = "".join(t[0] for t in layer_types)
    out = Path(tmpdir) / (name or f"qwen3_5-{tag}-h{hidden}-q{heads}-kv{kv_heads}-d{head_dim}{'-vl' if vision else ''}")
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def use_transformers_torch_gdn() -> None:
    """Make transformers' Qwen3.5 run its own torch delta rule: with fla-core installed it binds
    fla's Triton kernels at import, which cannot run on a CPU, and the oracle must be independent
    of the kernels under test anyway."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(m, name, inspect.unwrap(getattr(m, name)))
