"""The ``ninfer bench kernels`` report: ratios of each decode row to the int8 control and to
SDPA bf16, and the text table."""
from __future__ import annotations

import math


def _fmt(x, spec: str, na: str = "-") -> str:
    return na if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def add_ratios(rows: list[dict]) -> None:
    """Per (geometry, context, batch): ratio of each decode time to the best int8 and to SDPA."""
    keyf = lambda r: (r["hq"], r["hkv"], r["d"], r["context"], r["batch"])  # noqa: E731
    groups: dict = {}
    for r in rows:
        if r.get("kind") == "decode":
            groups.setdefault(keyf(r), []).append(r)
    for rs in groups.values():
        int8 = [r["us"] for r in rs if r["format"] == "int8" and "us" in r]
        base = {"int8": min(int8) if int8 else None}
        for be in ("flash", "cudnn"):
            t = [r["us"] for r in rs if r["format"] == "sdpa-bf16" and r["backend"] == be and "us" in r]
            base[be] = t[0] if t else None
        for r in rs:
            if "us" not in r:
                continue
            r["x_int8"] = r["us"] / base["int8"] if base["int8"] else None
            r["x_sdpa_flash"] = r["us"] / base["flash"] if base["flash"] else None
            r["x_sdpa_cudnn"] = r["us"] / base["cudnn"] if base["cudnn"] else None


def table(rows: list[dict]) -> str:
    lines = [f"{'geometry':<14}{'ctx':>6}{'B':>3}  {'kernel':<26}{'us':>9}{'MB':>8}{'%copy':>7}"
             f"{'xint8':>7}{'xflash':>7}{'xcudnn':>7}{'rel_err':>9}"]
    for r in rows:
        if r.get("kind") != "decode":
            continue
        geo = f"{r['hq']}q{r['hkv']}kv-d{r['d']}"
        ctx = f"{r['context'] // 1024}k"
        if "us" in r:
            lines.append(f"{geo:<14}{ctx:>6}{r['batch']:>3}  {r['label']:<26}{r['us']:>9.1f}{r['bytes'] / 1e6:>8.1f}"
                         f"{r['pct_copy']:>7.1f}{_fmt(r.get('x_int8'), '7.2f'):>7}{_fmt(r.get('x_sdpa_flash'), '7.2f'):>7}"
                         f"{_fmt(r.get('x_sdpa_cudnn'), '7.2f'):>7}{_fmt(r.get('rel_err'), '9.1e'):>9}")
        else:
            lines.append(f"{geo:<14}{ctx:>6}{r['batch']:>3}  {r['label']:<26}  {r.get('error', 'not run')[:80]}")
    other = [r for r in rows if r.get("kind") in ("store", "prefill", "absent")]
    for r in other:
        if r["kind"] == "absent":
            lines.append(f"{r['what']}: absent ({r['why']})")
        elif "error" in r:
            lines.append(f"{r['kind']} {r['format']}: {r['error'][:100]}")
        elif r["kind"] == "store":
            lines.append(f"store   {r['format']:<9} hkv={r['hkv']} d={r['d']} T={r['tokens']}: {r['us']:.1f} us "
                         f"{r['pct_copy']:.1f}% copy (whole pages); scattered slots {r['us_scattered']:.1f} us "
                         f"{r['pct_copy_scattered']:.1f}%")
        else:
            lines.append(f"prefill {r['format']:<9} {r['hq']}q{r['hkv']}kv-d{r['d']} ctx={r['context'] // 1024}k+"
                         f"{r['chunk']}: {r['us']:.1f} us x_int8={_fmt(r.get('x_int8'), '.2f')} "
                         f"{r['tflops']:.1f} TFLOP/s")
    return "\n".join(lines)
