"""Training batches assembled from pre-tokenized parts, so data keeps up with a GPU step.

`data.make_haystack` tokenizes text as it goes (35-41 ms per 8K-token batch); here the
same documents are built from ids: a bank of pre-tokenized filler sentences and per-key token
templates for needles, questions and answers (the value's " is NN" / "NN" tokens are spliced
in). `TokenBank` checks every template against tokenizing the full text, so a batch is exactly
what the tokenizer would produce for the same text.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from . import data
from .evaluate import encoder


class TokenBank:
    def __init__(self, tok, n_sentences: int = 20000, seed: int = 0):
        enc = encoder(tok)
        rng = random.Random(seed)
        sents = [data.filler_sentence(rng) for _ in range(n_sentences)]
        sents = [s for s in sents if not s.startswith("\n")] + [s for s in sents if s.startswith("\n")]
        self.sentences = [np.asarray(x, dtype=np.int64) for x in enc(sents)]
        self.head = enc([data.USER + "\n"])[0]
        self.is_nn = [enc([f" is {i:02d}"])[0][0] for i in range(100)]
        self.nn = [enc([f"{i:02d}"])[0][0] for i in range(100)]
        keys = list(data.LEXICON.keys)
        # a value "1234" -> [" is 12", "34"] closes needle and answer: "... for K" + value + "."
        needle = enc([data.needle_sentence(k, "1234") for k in keys])
        answer = enc([data.answer_text(k, "1234") + data.END for k in keys])
        q_first = enc([data.question_turn(k, True) for k in keys])
        q_next = enc([data.question_turn(k, False) for k in keys])
        tail = [self.is_nn[12], self.nn[34]]
        for ids in needle:
            assert ids[-3:-1] == tail, "needle does not end in ' is NN' 'NN' '.'"
        for ids in answer:
            assert ids[-4:-2] == tail, "answer does not end in ' is NN' 'NN' '.' end"
        self.needle_pre = [x[:-3] for x in needle]
        self.dot = needle[0][-1]
        self.answer_pre = [x[:-4] for x in answer]
        self.end = answer[0][-1]
        self.q_first, self.q_next = q_first, q_next
        self.key_index = {k: i for i, k in enumerate(keys)}

    def needle_ids(self, k: int, v: int) -> list[int]:
        return self.needle_pre[k] + [self.is_nn[v // 100], self.nn[v % 100], self.dot]

    def answer_ids(self, k: int, v: int) -> list[int]:
        return self.answer_pre[k] + [self.is_nn[v // 100], self.nn[v % 100], self.dot, self.end]

    def document(self, rng: np.random.Generator, L: int, n_needles: int, gap_mult: float,
                 lm_weight: float, doc_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One training row of at most L tokens: (ids, positions, loss weights, answer ids)."""
        keys = rng.choice(len(self.needle_pre), n_needles, replace=False)
        heads = rng.choice(100, n_needles, replace=False)  # distinct " is NN" per document
        vals = heads * 100 + rng.integers(0, 100, n_needles)
        needles = [self.needle_ids(k, v) for k, v in zip(keys, vals)]
        order = rng.permutation(n_needles)
        turns = []
        for j, i in enumerate(order):
            q = (self.q_first if j == 0 else self.q_next)[keys[i]]
            turns.append((q, False))
            turns.append((self.answer_ids(keys[i], vals[i]), True))
        budget = L - len(self.head) - sum(map(len, needles)) - sum(len(t) for t, _ in turns)
        pieces: list[np.ndarray] = []
        total = 0
        while True:
            s = self.sentences[rng.integers(len(self.sentences))]
            if total + len(s) > budget:
                break
            pieces.append(s)
            total += len(s)
        # needles after the filler sentence where the cumulative count reaches their depth
        depths = np.sort(rng.random(n_needles)) * total
        cum = np.cumsum([0] + [len(p) for p in pieces])
        where = np.searchsorted(cum[:-1], depths, side="left") if pieces else np.zeros(n_needles, int)
        parts: list = [self.head]
        starts = []  # part index of every filler sentence (a position gap may go before it)
        j = 0
        for i, p in enumerate(pieces):
            while j < n_needles and where[j] <= i:
                parts.append(needles[j]); j += 1
            starts.append(len(parts))
            parts.append(p)
        parts += needles[j:]
        doc_len = sum(len(p) for p in parts)
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts] +
                             [np.asarray(t, dtype=np.int64) for t, _ in turns])
        w = np.full(len(ids), lm_weight, dtype=np.float32)
        seg = np.zeros(len(ids), dtype=np.int64)
        at = doc_len
        for n, (t, tgt) in enumerate(turns):
            if tgt:
                w[at:at + len(t)] = 1.0
                seg[at:at + len(t)] = doc_id * 1000 + n + 1
            at += len(t)
        pos = np.arange(len(ids))
        if gap_mult > 0 and rng.random() < 0.5 and starts:
            offs = np.cumsum([0] + [len(p) for p in parts])
            cuts = rng.choice(starts, min(len(starts), int(rng.integers(1, 9))), replace=False)
            shares = rng.random(len(cuts))
            jump = np.zeros(len(ids), dtype=np.int64)
            jump[0] = rng.integers(4096)
            extra = int(rng.random() * gap_mult * len(ids))
            for c, s in zip(cuts, shares):
                jump[offs[c]] += int(extra * s / shares.sum())
            pos = pos + np.cumsum(jump)
        return ids, pos, w, seg

    def batch(self, rng: np.random.Generator, L: int, tokens: int, needles: tuple[int, int],
              gap_mult: float = 0.0, lm_weight: float = 0.02):
        """About `tokens` tokens of length-<=L rows, padded: (ids, pos, weights, answer ids)."""
        rows = [self.document(rng, L, int(rng.integers(needles[0], needles[1] + 1)), gap_mult, lm_weight, r)
                for r in range(max(1, tokens // L))]
        T = max(len(r[0]) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        pos = torch.zeros(len(rows), T, dtype=torch.long)
        wts = torch.zeros(len(rows), T)
        seg = torch.zeros(len(rows), T, dtype=torch.long)
        for i, (a, p, w, sg) in enumerate(rows):
            n = len(a)
            ids[i, :n], wts[i, :n], seg[i, :n] = torch.from_numpy(a), torch.from_numpy(w), torch.from_numpy(sg)
            pos[i, :n] = torch.from_numpy(p)
            pos[i, n:] = torch.arange(int(p[-1]) + 1, int(p[-1]) + 1 + T - n)
        return ids, pos, wts, seg
