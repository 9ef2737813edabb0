"""Choose the best of several probe training runs by their measured retrieval and ship it.

    python -m ninfer.tools.probe.pick --out DIR --report FILE RUN_DIR [RUN_DIR ...]

Used as a hedge: several train.py processes share the one GPU, differing in seed or one setting,
and whether key matching forms within the budget varies from run to run (in one set of four runs,
one setting's did), so the best measured one ships.

Each RUN_DIR holds `probe/` (an HF dir) and `probe_train.json` (train.py's report). The score is
the mean exact retrieval over every evaluated length (mean margin breaks ties). If the run's
YaRN evaluation answers strictly more needles than plain RoPE on the lengths both covered, the YaRN rope parameters are
written into the shipped config.json (same weights), and max_position_embeddings follows them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def _score(ev: dict, lengths=None) -> tuple[float, float]:
    rows = [v for k, v in ev.items() if isinstance(v, dict) and "exact" in v and (lengths is None or k in lengths)]
    if not rows:
        return (-1.0, float("-inf"))
    return (sum(r["exact"] for r in rows) / len(rows), sum(r["mean_margin"] for r in rows) / len(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ninfer.tools.probe.pick")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    cands = {}
    for r in a.runs:
        rep = Path(r) / "probe_train.json"
        if rep.exists() and (Path(r) / "probe" / "config.json").exists():
            cands[r] = json.loads(rep.read_text())
    if not cands:
        print("pick: no finished run", file=sys.stderr)
        return 1
    scores = {r: _score(c["eval"]["rope_default"]) for r, c in cands.items()}
    best = max(scores, key=lambda r: scores[r])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in (Path(best) / "probe").iterdir():
        shutil.copy2(f, out / f.name)
    ev = cands[best]["eval"]
    rope = {"choice": "default"}
    if "yarn" in ev:
        common = [k for k, v in ev["yarn"].items() if isinstance(v, dict) and "exact" in v]
        plain, yarn = _score(ev["rope_default"], common), _score(ev["yarn"], common)
        rope = {"lengths": common, "default": plain, "yarn": yarn, "choice": "default"}
        if yarn[0] > plain[0]:  # strictly more exact answers, over every length both covered
            rp = ev["yarn"]["rope_parameters"]
            cfg = json.loads((out / "config.json").read_text())
            cfg["rope_parameters"] = rp
            cfg["max_position_embeddings"] = int(rp["original_max_position_embeddings"] * rp["factor"])
            (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            rope["choice"] = "yarn"
    merged = {"chosen": best, "scores": {r: list(s) for r, s in scores.items()}, "rope": rope,
              "files": sorted(p.name for p in out.iterdir()), "runs": cands}
    Path(a.report).write_text(json.dumps(merged, indent=1))
    print(f"pick: {best} scores {scores} rope {rope['choice']} -> {out}")
    for r, c in cands.items():
        print(f"  {r}: " + ", ".join(f"{k}:{v['exact']:.2f}" for k, v in c["eval"]["rope_default"].items() if "exact" in v))
        if "yarn" in c["eval"]:
            print("    yarn: " + ", ".join(f"{k}:{v['exact']:.2f}" for k, v in c["eval"]["yarn"].items()
                                        if isinstance(v, dict) and "exact" in v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
