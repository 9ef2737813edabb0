"""Deterministic synthetic retrieval documents, shared by training and the needle bench.

A document is word-like filler (pseudo-words from a fixed lexicon, Zipf-distributed, in
sentences and paragraphs) with needles "The secret code for <key> is <value>." inserted at
given depths. Keys are single pseudo-words from a key list disjoint from the filler, so one key
is one token in both needle and question; values are four digits (two 2-digit tokens).

The prompt is the chat format of the probe's template (tokenizer.py):
    <|user|>\\n{document}\\n\\nWhat is the secret code for {key}?<|end|>\\n<|assistant|>\\n
and the answer repeats the needle: "The secret code for {key} is {value}.<|end|>".

Pieces are built so that tokenizing the whole text equals concatenating the tokens of the pieces
(every piece starts at a pre-token boundary); tests assert this, and training relies on it to
count and assemble tokens without re-tokenizing whole documents.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

LEXICON_SEED = 20261129  # fixed: the tokenizer and the shipped model depend on this lexicon
N_FILLER_WORDS = 600
N_KEYS = 256
BENCH_DEPTHS = (0.10, 0.25, 0.50, 0.75, 0.90)

USER, ASSISTANT, END, PAD = "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, USER, ASSISTANT, END]

_ONSETS = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "cr", "dr", "gr", "pl", "st", "tr", "sh", "th", "ch"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "nd", "st"]
# Real function words make the filler read like text; "secret", "code", "for" stay out of it.
_FUNCTION = ["the", "a", "of", "and", "to", "in", "is", "was", "with", "on", "that", "it",
             "as", "by", "from", "at", "or", "but", "not", "this", "which", "are", "be", "an"]


def _syllable(rng: random.Random, coda: bool) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + (rng.choice(_CODAS) if coda else "")


@dataclass(frozen=True)
class Lexicon:
    filler: tuple[str, ...]
    weights: tuple[float, ...]
    keys: tuple[str, ...]


def _make_lexicon() -> Lexicon:
    rng = random.Random(LEXICON_SEED)
    seen = set(_FUNCTION) | {"secret", "code", "question", "answer", "what"}
    keys: list[str] = []
    while len(keys) < N_KEYS:  # keys: two syllables, distinct from each other and from filler
        w = _syllable(rng, False) + _syllable(rng, True)
        if w not in seen:
            seen.add(w)
            keys.append(w)
    words: list[str] = []
    while len(words) < N_FILLER_WORDS:
        w = "".join(_syllable(rng, i == 0 or rng.random() < 0.5) for i in range(rng.choice([1, 1, 2, 2, 3])))
        if w not in seen and len(w) > 1:
            seen.add(w)
            words.append(w)
    filler = _FUNCTION + words
    # Zipf-like: function words are the most frequent, as in real text.
    weights = [1.0 / (i + 2) ** 1.0 for i in range(len(filler))]
    return Lexicon(tuple(filler), tuple(weights), tuple(keys))


LEXICON = _make_lexicon()


def filler_sentence(rng: random.Random, lex: Lexicon = LEXICON) -> str:
    """One sentence with a leading space (or a paragraph break), e.g. " Tor the bleam, of stu."."""
    n = rng.randint(4, 14)
    words = rng.choices(lex.filler, lex.weights, k=n)
    words[0] = words[0].capitalize()
    if n > 7 and rng.random() < 0.3:
        words[rng.randint(2, n - 3)] += ","
    lead = "\n\n" if rng.random() < 0.08 else " "
    return lead + " ".join(words) + "."


def needle_sentence(key: str, value: str) -> str:
    return f" The secret code for {key} is {value}."


def answer_text(key: str, value: str) -> str:
    """The assistant's answer: the needle sentence repeated (without the leading space)."""
    return needle_sentence(key, value)[1:]


def question_text(key: str) -> str:
    return f"What is the secret code for {key}?"


def chat_prompt(document: str, key: str) -> str:
    """The bench/eval prompt for one needle: the chat template applied to one user turn."""
    return f"{USER}\n{document}\n\n{question_text(key)}{END}\n{ASSISTANT}\n"


def random_value(rng: random.Random) -> str:
    return f"{rng.randrange(10000):04d}"


@dataclass
class Needle:
    key: str
    value: str
    depth: float


@dataclass
class Haystack:
    pieces: list[str]              # filler and needle sentences, in order
    needles: list[Needle]
    piece_ids: list[list[int]] = field(default_factory=list)  # token ids per piece, if tokenized

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def make_haystack(rng: random.Random, n_tokens: int, n_needles: int | None = None,
                  depths: Sequence[float] | None = None,
                  tokenize: Callable[[list[str]], list[list[int]]] | None = None,
                  lex: Lexicon = LEXICON) -> Haystack:
    """At most `n_tokens` tokens (within one sentence of it) of filler and needles, measured
    exactly when `tokenize` is given (else ~1.9 tokens per word is assumed), with needles at
    `depths` (fractions of the filler)."""
    if depths is None:
        depths = sorted(rng.random() for _ in range(n_needles or 1))
    keys = rng.sample(lex.keys, len(depths))
    # distinct first digit pairs within a document: " is NN" alone then names one needle
    heads = rng.sample(range(100), len(depths))
    needles = [Needle(k, f"{h:02d}{rng.randrange(100):02d}", d) for k, h, d in zip(keys, heads, depths)]
    needle_pieces = [needle_sentence(n.key, n.value) for n in needles]
    needle_ids = tokenize(needle_pieces) if tokenize else [[0] * 10 for _ in needle_pieces]
    budget = n_tokens - sum(len(x) for x in needle_ids)
    filler: list[str] = []
    filler_ids: list[list[int]] = []
    total = 0
    full = False
    while not full:  # generate in chunks, measuring as we go; never exceed the budget
        chunk = [filler_sentence(rng, lex) for _ in range(max(8, (budget - total) // 12))]
        ids = tokenize(chunk) if tokenize else [[0] * round(1.9 * len(s.split())) for s in chunk]
        for s, t in zip(chunk, ids):
            if total + len(t) > budget:
                full = True
                break
            filler.append(s)
            filler_ids.append(t)
            total += len(t)
    # Insert each needle after the filler sentence where the cumulative count reaches its depth.
    cum, acc = [], 0
    for t in filler_ids:
        cum.append(acc)
        acc += len(t)
    order = sorted(range(len(needles)), key=lambda i: needles[i].depth)
    pieces, pids = [], []
    j = 0
    for i, (s, t) in enumerate(zip(filler, filler_ids)):
        while j < len(order) and cum[i] >= needles[order[j]].depth * total:
            pieces.append(needle_pieces[order[j]]); pids.append(needle_ids[order[j]]); j += 1
        pieces.append(s); pids.append(t)
    while j < len(order):
        pieces.append(needle_pieces[order[j]]); pids.append(needle_ids[order[j]]); j += 1
    if pieces and pieces[0] != pieces[0].lstrip():
        pieces[0] = pieces[0].lstrip()  # the document starts right after "<|user|>\n"
        if tokenize:
            pids[0] = tokenize([pieces[0]])[0]
    return Haystack(pieces, needles, pids if tokenize else [])


def bench_haystack(context_tokens: int, seed: int,
                   tokenize: Callable[[list[str]], list[list[int]]],
                   depths: Sequence[float] = BENCH_DEPTHS) -> Haystack:
    """The needle bench's document: five needles at 10/25/50/75/90% depth, sized so that the
    longest prompt plus its answer fits in `context_tokens` (question + answer ~ 24 tokens)."""
    return make_haystack(random.Random(seed), context_tokens - 32, depths=list(depths), tokenize=tokenize)


def question_turn(key: str, first: bool) -> str:
    """The user turn asking for `key` in a training chat, up to the assistant's header: the first
    closes the document's turn (so document + it == chat_prompt), later ones open a new turn."""
    opener = "\n\n" if first else f"\n{USER}\n"
    return f"{opener}{question_text(key)}{END}\n{ASSISTANT}\n"


def training_turns(hay: Haystack, rng: random.Random) -> list[tuple[str, bool]]:
    """A multi-turn chat asking every needle, in random order; (text, is_target) segments.
    The first segment is exactly chat_prompt(document, first key) minus the document."""
    order = list(range(len(hay.needles)))
    rng.shuffle(order)
    segs: list[tuple[str, bool]] = []
    for n, i in enumerate(order):
        nd = hay.needles[i]
        segs.append((question_turn(nd.key, n == 0), False))
        segs.append((answer_text(nd.key, nd.value) + END, True))
    return segs
