"""`ninfer bench needle`: the scoring pieces, and the bundled probe model through the engine
in-process on CPU (5/5 needles at 4K for bf16, int8 and rk4v4-e8 KV)."""
from __future__ import annotations

import math

import pytest

from ninfer.bench import needle
from ninfer.tools.probe import data, default_model_dir


def test_score_margin_signs() -> None:
    gold = [5, 6, 7]
    lp = [math.log(0.99), math.log(0.9), math.log(0.999)]
    m = needle.score(gold, [5, 6, 7], lp)
    assert m == pytest.approx(math.log(0.9 / 0.1), abs=1e-3)  # weakest right token
    # a wrong token chosen with p=0.4: the right one had at most 0.4 -> margin <= log(0.4/0.6) < 0
    m = needle.score(gold, [5, 9, 7], [math.log(0.99), math.log(0.4), 0.0])
    assert m == pytest.approx(-abs(math.log(0.4 / 0.6)), abs=1e-3) and m < 0
    assert needle.score(gold, [5, 6, 7], None) is None


def test_table_lists_every_depth() -> None:
    rows = [{"context": 4096, "depth": d, "passed": d != 0.5, "margin": 3.0 if d != 0.5 else -1.0}
            for d in data.BENCH_DEPTHS]
    t = needle.table({"int8": rows})
    assert "int8" in t and " 4/5 " in t and "0/1 -1.0" in t and t.count("ok +3.0") == 4


_HAVE_MODEL = (default_model_dir() / "config.json").is_file()
_ROWS: dict[str, list[dict]] = {}


def _rows(kv_dtype: str) -> list[dict]:
    """One 4K document, five questions, through the engine on CPU, once per format per session.
    Prefix reuse ON: the document is prefilled by the first question and its cached pages serve
    the other four, so a format costs one 4K prefill instead of five. The answers equal those of
    a recomputation (DESIGN §7's prefix-reuse-off rule is about timing benchmarks): cached pages
    hold exactly the K/V, in the stored format, that recomputing the prefix would store."""
    if kv_dtype not in _ROWS:
        _ROWS[kv_dtype] = needle.run_inprocess(str(default_model_dir()), kv_dtype, [4096], docs=1, seed=0,
                                               device="cpu", prefix_reuse=True)
    return _ROWS[kv_dtype]


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_MODEL, reason="no bundled probe model")
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "rk4v4-e8"])
def test_bundled_probe_4k_answers_form(kv_dtype: str) -> None:
    """Independent of what the model learned: five answers that stop, and the reuse happened."""
    rows = _rows(kv_dtype)
    assert len(rows) == 5
    assert all(r["finish_reason"] == "stop" for r in rows), rows
    assert all(r["prompt_tokens"] > 3900 for r in rows), rows
    assert all((r.get("cached_tokens") or 0) > 3000 for r in rows[1:]), rows


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_MODEL, reason="no bundled probe model")
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "rk4v4-e8"])
def test_bundled_probe_needles_4k(kv_dtype: str) -> None:
    rows = _rows(kv_dtype)
    assert [r["passed"] for r in rows] == [True] * 5, rows
