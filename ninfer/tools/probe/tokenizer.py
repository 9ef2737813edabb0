"""The probe's tokenizer: byte-level BPE trained with `tokenizers` on the synthetic corpus.

A needle "The secret code for K is 4821." tokenizes as ... " K" " is 48" "21" "."; the answer
repeats that sentence, so retrieval is two induction steps (" K" -> " is 48", " is 48" -> "21").
Every key and every " is NN" / "NN" must be one token (checked at build time).
"""
from __future__ import annotations

import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .data import (ASSISTANT, END, LEXICON, PAD, SPECIAL_TOKENS, USER, filler_sentence,
                   needle_sentence, question_text, random_value)

VOCAB_SIZE = 2048
# GPT-2's word split, except: " is " + two digits is one piece (so in a needle the value's first
# token directly follows the key and is itself distinctive, making retrieval a plain induction
# "find my key, copy what follows"), and digits go in pairs (values are always two tokens).
SPLIT_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| is \d\d| ?\d\d?| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ '" + ASSISTANT + "\\n' + m['content'] + '" + END + "\\n' }}"
    "{%- else -%}{{ '" + USER + "\\n' + m['content'] + '" + END + "\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '" + ASSISTANT + "\\n' }}{%- endif -%}"
)
# A little ordinary text so prompts outside the task (sanity bench) tokenize sensibly.
_GENERIC = ("Explain why the sky is blue. What is 17 + 25? def add(a, b):\n    return a + b\n"
            "The quick brown fox jumps over the lazy dog. print('hello, world') x = [1, 2, 3]\n")


def _corpus(seed: int = 0, n_sentences: int = 60000) -> list[str]:
    rng = random.Random(seed)
    lines = ["".join(filler_sentence(rng) for _ in range(20)) for _ in range(n_sentences // 20)]
    for _ in range(300):  # every key often enough to become one token
        lines.append("".join(needle_sentence(k, random_value(rng)) + " " + question_text(k)
                             for k in LEXICON.keys))
    lines += [f"{USER}\n{ASSISTANT}\n{END}"] * 10 + [_GENERIC] * 20
    return lines


def build_tokenizer(seed: int = 0) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    _check(tok)
    return tok


def _check(tok: Tokenizer) -> None:
    bad = [k for k in LEXICON.keys if len(tok.encode(" " + k).ids) != 1]
    bad += [f"{i:02d}" for i in range(100) if len(tok.encode(f"{i:02d}").ids) != 1]
    bad += [f" is {i:02d}" for i in range(100) if len(tok.encode(f" is {i:02d}").ids) != 1]
    if bad:
        raise RuntimeError(f"probe tokenizer: {len(bad)} keys/digit pairs are not single tokens: {bad[:8]}")


def wrap(tok: Tokenizer, model_max_length: int = 65536):
    """A transformers PreTrainedTokenizerFast with the chat template and special tokens set."""
    from transformers import PreTrainedTokenizerFast
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, pad_token=PAD,
                                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
