"""`ninfer bench sweep --from-json A B --plot PNG`: the plot of earlier runs, one JSON per kv-dtype."""
import json

import pytest

pytest.importorskip("matplotlib")
from ninfer.bench.sweep import plot_from_json  # noqa: E402


def _sweep(kv: str, rows: list[dict]) -> dict:
    return {"bench": "sweep", "env": {"gpu": "cpu", "date_utc": "2026-12-01T00:00:00Z"}, "model": "/x/m",
            "settings": {"memory_limit_gib": 32.0, "gen_tokens": 32}, "results": {kv: {"rows": rows}}}


def test_plot_from_json_merges_runs_and_writes_a_png(tmp_path):
    rows = [{"context": c, "prefill_tok_s": 1e6 / c, "decode_tok_s": 100.0 - c / 1e4} for c in (32768, 65536)]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_sweep("int8", rows)))
    b.write_text(json.dumps(_sweep("rk4v4-e8", rows + [{"context": 131072, "skipped": "does not fit"}])))
    png = tmp_path / "out" / "sweep.png"
    merged = plot_from_json([str(a), str(b)], str(png))
    assert list(merged) == ["int8", "rk4v4-e8"] and len(merged["rk4v4-e8"]["rows"]) == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_from_json_rejects_a_file_that_is_not_a_sweep(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"bench": "codec"}))
    with pytest.raises(SystemExit, match="not a sweep JSON"):
        plot_from_json([str(bad)], str(tmp_path / "x.png"))
