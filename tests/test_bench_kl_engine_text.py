"""`ninfer bench kl --text --engine`: KL on the shipped passages through the engine's real paths."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer import cli


def test_engine_text_kl_orders_the_formats(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Forced decode along real text: int8 loses less than rk4v4-e8, and rk4v4-e8w, whose window holds
    most of each scored step's history in full precision, less than rk4v4-e8 (fails if the window is
    not read); every passage but the calibration one is scored, every step of each."""
    out = tmp_path / "kl.json"
    assert cli.main(["bench", "kl", str(tiny_model_dir), "--text", "--engine", "--kv-dtype",
                     "int8,rk4v4-e8,rk4v4-e8w", "--tokens", "176", "--scored", "24", "--device", "cpu",
                     "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["kv_dtype"]: r for r in res["rows"]}
    assert "bread" not in res["passages"] and len(res["passages"]) >= 3
    assert all(d["n"] == 24 for r in rows.values() for d in r["docs"].values())
    assert 0 < rows["int8"]["mean_kl"] < rows["rk4v4-e8"]["mean_kl"]
    assert rows["rk4v4-e8w"]["mean_kl"] < 0.6 * rows["rk4v4-e8"]["mean_kl"], rows


def test_engine_text_kl_refuses_bad_lengths(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit, match="--scored must be in"):
        cli.main(["bench", "kl", str(tiny_model_dir), "--text", "--engine", "--kv-dtype", "int8",
                  "--tokens", "64", "--scored", "64", "--device", "cpu"])


def test_engine_text_kl_joined_passages(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--join: one document per rotation of the held-out passages, long enough for a prompt no single
    passage holds."""
    out = tmp_path / "kl.json"
    assert cli.main(["bench", "kl", str(tiny_model_dir), "--text", "--engine", "--join", "--kv-dtype", "int8",
                     "--tokens", "1200", "--scored", "4", "--device", "cpu", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    names = res["passages"]
    assert len(names) >= 3 and len(set(names)) == len(names) and all("+" in n for n in names)
    assert all(sorted(n.split("+")) == sorted(names[0].split("+")) for n in names)
    assert res["rows"][0]["docs"][names[0]]["n"] == 4


def test_engine_flags_need_text(tiny_model_dir: Path) -> None:
    for argv in (["--engine"], ["--text", "--join"]):
        with pytest.raises(SystemExit, match="--join needs --engine, and --engine needs --text"):
            cli.main(["bench", "kl", str(tiny_model_dir), *argv, "--device", "cpu"])
