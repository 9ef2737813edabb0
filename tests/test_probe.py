"""The probe data generator, tokenizer, training smoke run, and the bundled probe model's own
retrieval measured with transformers (an independent reference, no ninfer engine)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from ninfer.tools.probe import data, default_model_dir, repo_root
from ninfer.tools.probe.evaluate import encoder, log_odds, log_odds_from_logprob


@pytest.fixture(scope="module")
def tok():
    from ninfer.tools.probe.tokenizer import build_tokenizer
    return build_tokenizer()


def test_default_model_dir_is_in_repo() -> None:
    assert default_model_dir() == repo_root() / "models" / "probe"
    assert (repo_root() / "ninfer" / "tools" / "probe" / "data.py").is_file()


def test_lexicon_fixed_and_disjoint() -> None:
    assert len(data.LEXICON.keys) == data.N_KEYS and len(set(data.LEXICON.keys)) == data.N_KEYS
    assert not set(data.LEXICON.keys) & set(data.LEXICON.filler)
    assert {"secret", "code", "for"}.isdisjoint(data.LEXICON.filler)


def test_haystack_deterministic_and_structured(tok) -> None:
    enc = encoder(tok)
    a = data.make_haystack(random.Random(7), 600, depths=list(data.BENCH_DEPTHS), tokenize=enc)
    b = data.make_haystack(random.Random(7), 600, depths=list(data.BENCH_DEPTHS), tokenize=enc)
    c = data.make_haystack(random.Random(8), 600, depths=list(data.BENCH_DEPTHS), tokenize=enc)
    assert a.text == b.text and a.text != c.text
    assert [n.depth for n in a.needles] == list(data.BENCH_DEPTHS)
    assert len({n.key for n in a.needles}) == 5 and len({n.value[:2] for n in a.needles}) == 5
    # needles appear in depth order, at about their depth
    ids = [t for p in a.piece_ids for t in p]
    assert len(ids) <= 600 and len(ids) > 560
    pos = [a.text.index(data.needle_sentence(n.key, n.value).strip()) for n in a.needles]
    assert pos == sorted(pos)
    for n, p in zip(a.needles, pos):
        assert abs(p / len(a.text) - n.depth) < 0.08
    # tokenizing the whole text equals concatenating the pieces' tokens (training relies on it)
    assert ids == tok.encode(a.text).ids


def test_prompt_and_answer_tokens(tok) -> None:
    hay = data.bench_haystack(1024, 3, encoder(tok))
    n = hay.needles[2]
    prompt = data.chat_prompt(hay.text, n.key)
    ids = tok.encode(prompt).ids
    assert len(ids) + len(tok.encode(data.answer_text(n.key, n.value) + data.END).ids) <= 1024
    assert prompt.startswith(data.USER + "\n") and prompt.endswith(data.ASSISTANT + "\n")
    # key is one token in needle and question; the value is " is NN" + "NN"
    ans = tok.encode(data.answer_text(n.key, n.value)).tokens
    assert ans[4] == "Ġ" + n.key and ans[5] == f"ĠisĠ{n.value[:2]}" and ans[6] == n.value[2:]
    # the chat template renders exactly the same prompt
    from ninfer.tools.probe.tokenizer import wrap
    user = hay.text + "\n\n" + data.question_text(n.key)
    assert wrap(tok).apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True) == prompt


def test_training_turns_ask_every_needle() -> None:
    hay = data.make_haystack(random.Random(1), 400, 4)
    segs = data.training_turns(hay, random.Random(2))
    answers = [s for s, t in segs if t]
    assert sorted(answers) == sorted(data.answer_text(n.key, n.value) + data.END for n in hay.needles)


def test_log_odds() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]])
    lo = log_odds(logits, torch.tensor([0, 0]))
    p = torch.softmax(logits, -1)[:, 0]
    assert torch.allclose(lo, torch.log(p / (1 - p)), atol=1e-5)
    assert abs(log_odds_from_logprob(float(torch.log(p[0]))) - float(lo[0])) < 1e-4


def test_tiny_training_writes_loadable_hf_dir(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ninfer.tools.probe import train
    out = tmp_path / "probe"
    assert train.main(["--out", str(out), "--tiny", "--minutes", "0.1", "--device", "cpu",
                       "--eval-lengths", "256", "--eval-docs", "1", "--eval-minutes", "0.5"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert len(files) <= 7 and all((out / f).stat().st_size < 15 * 2**20 for f in files)
    report = json.loads((tmp_path / "probe_train.json").read_text())
    assert report["steps"] >= 1 and "256" in report["eval"]["rope_default"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tk = AutoTokenizer.from_pretrained(out)
    assert tk.eos_token == data.END and model.generation_config.eos_token_id == tk.eos_token_id
    ids = tk.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                 return_tensors="pt", return_dict=True)["input_ids"]
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size


_HAVE_MODEL = (default_model_dir() / "config.json").is_file()


@pytest.mark.skipif(not _HAVE_MODEL, reason="no bundled probe model")
def test_bundled_probe_shape_and_files() -> None:
    """The probe's geometry: head_dim 256, 6 Q heads per KV head, >= 4 layers, files <= 16 MiB."""
    d = default_model_dir()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] == 256
    assert cfg["num_attention_heads"] == 6 * cfg["num_key_value_heads"] and cfg["num_hidden_layers"] >= 4
    files = sorted(p.name for p in d.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert len(files) <= 7 and all((d / f).stat().st_size <= 16 * 2**20 for f in files)


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_MODEL, reason="no bundled probe model")
def test_bundled_probe_retrieves_5_of_5_at_4k() -> None:
    """The shipped model, in fp32 with transformers on CPU: five needles at 10/25/50/75/90% of a
    4K document, each asked on its own, all answered exactly (answer + end token)."""
    from ninfer.tools.probe.evaluate import eval_document, load
    model, tk = load(default_model_dir(), dtype=torch.float32)
    hay = data.bench_haystack(4096, 0, encoder(tk))
    rows = eval_document(model, encoder(tk), hay, "cpu")
    assert [r["exact"] for r in rows] == [True] * 5, rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_bank_documents_equal_tokenized_text(tok, seed: int) -> None:
    """Training rows built from ids are exactly what the tokenizer makes of their text, and every
    answer turn names a needle of its document with that needle's value."""
    import re
    import numpy as np
    from ninfer.tools.probe.batches import TokenBank
    bank = TokenBank(tok, n_sentences=500, seed=seed)
    rng = np.random.default_rng(seed)
    for L, n in ((192, 2), (700, 5)):
        ids, pos, w, seg = bank.document(rng, L, n, gap_mult=4.0, lm_weight=0.02, doc_id=1)
        assert len(ids) <= L and (np.diff(pos) >= 1).all()
        text = tok.decode(ids.tolist(), skip_special_tokens=False)
        assert tok.encode(text).ids == ids.tolist()
        needles = dict(re.findall(r"The secret code for (\w+) is (\d{4})\.", text.split(data.ASSISTANT)[0]))
        assert len(needles) == n
        answers = [tok.decode(ids[seg == s].tolist(), skip_special_tokens=False) for s in np.unique(seg[seg > 0])]
        assert len(answers) == n and all(w[seg > 0] == 1.0)
        for a in answers:
            k, v = re.fullmatch(r"The secret code for (\w+) is (\d{4})\.<\|end\|>", a).groups()
            assert needles[k] == v
