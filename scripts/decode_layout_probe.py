"""Does the pool's layout change how fast the CUDA decode kernel streams? Same kernel, same bytes,
three layouts of one page's K/V for a KV head, on one GPU, side by side.

    PYTHONPATH=$PWD python3 scripts/decode_layout_probe.py --out $OUT/decode_layout.json

* ``planes``: today's pool: four planes (k, k_scale, v, v_scale), each [pages, kv heads, 64, extent];
  a page's K for one head is 64 x extent contiguous bytes (4 KB for 4-bit D128), its V elsewhere.
* ``kv``: K and V of a (page, head) adjacent ([pages, heads, 2, 64, extent] data, the same for
  scales): one 2 x 4 KB run per (page, head) at 4-bit D128.
* ``block``: everything of a (page, head) in one run: K data | V data | K scales | V scales.
The split kernel only needs K and V to share strides (and the scales theirs), so it runs unchanged
on strided views; this script launches it directly (``paged_decode_cuda`` insists on contiguous planes).
Each layout holds the same bytes and is checked against the float64 oracle; the calls of a replay
rotate over page sets that exceed the L2 four times (as the kernel bench), rounds alternate order.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from ninfer.bench.kernels import DecodeCase, time_graph  # noqa: E402
from ninfer.kernels import paged_decode_cuda as pdc  # noqa: E402
from ninfer.kernels.decode_reduce import decode_reduce  # noqa: E402
from ninfer.kernels.paged_decode import paged_decode_ref  # noqa: E402

LAYOUTS = ("planes", "kv", "block")


def relayout(planes: dict, layout: str) -> dict:
    """The same bytes as strided views of one allocation in ``layout``."""
    if layout == "planes":
        return planes
    kd, ks = planes["k"], planes["k_scale"]
    p, h, t, rb = kd.shape
    g = ks.shape[-1]
    if layout == "kv":
        data = torch.empty(p, h, 2, t, rb, dtype=kd.dtype, device=kd.device)
        sc = torch.empty(p, h, 2, t, g, dtype=ks.dtype, device=ks.device)
        out = {"k": data[:, :, 0], "v": data[:, :, 1], "k_scale": sc[:, :, 0], "v_scale": sc[:, :, 1]}
    else:
        nd, ns = t * rb, t * g * 2
        buf = torch.empty(p, h, 2 * nd + 2 * ns, dtype=torch.uint8, device=kd.device)
        out = {"k": buf[..., :nd].view(kd.dtype).unflatten(-1, (t, rb)),
               "v": buf[..., nd:2 * nd].view(kd.dtype).unflatten(-1, (t, rb)),
               "k_scale": buf[..., 2 * nd:2 * nd + ns].view(torch.float16).unflatten(-1, (t, g)),
               "v_scale": buf[..., 2 * nd + ns:].view(torch.float16).unflatten(-1, (t, g))}
    for name, x in out.items():
        x.copy_(planes[name])
    return out


def case_rows(fmt_name: str, geom: tuple, ctx: int, bsz: int, rounds: int) -> dict:
    hq, hkv, d = geom
    c = DecodeCase(fmt_name, hq, hkv, d, ctx, bsz)
    code = c.fmt.kernel_code
    cfg = pdc.default_cfg(code, d)
    splits = pdc.cuda_num_splits(bsz, hkv, c.tables[0].shape[1], c.q.device, c.fmt, d, c.q.dtype, cfg)
    mid_o = torch.empty(bsz * hq, splits, d, dtype=torch.float32, device=c.q.device)
    mid_lse = torch.empty(bsz * hq, splits, dtype=torch.float32, device=c.q.device)

    def call(pl, i):  # paged_decode_cuda's launch, on planes it would not take (strided views)
        pdc._paged_decode_cuda_split(c.q, pl["k"], pl["k_scale"], pl["v"], pl["v_scale"], c.tables[i], c.seq_lens,
                                     mid_o, mid_lse, code, c.scale, splits, cfg)
        decode_reduce(mid_o, mid_lse, c.outs[i].view(bsz * hq, d), rotated=False)

    ref = paged_decode_ref(c.q, c.kp, c.vp, c.tables[0], c.seq_lens, c.fmt, c.scale)
    row = {"format": fmt_name, "geometry": f"{hq}q/{hkv}kv/D{d}", "ctx": ctx, "batch": bsz, "sets": c.sets,
           "splits": splits, "cfg": list(cfg)}
    calls = {}
    for lay in LAYOUTS:
        pl = relayout(c.planes, lay)
        c.outs[0].fill_(float("nan"))
        call(pl, 0)
        row[f"rel_err_{lay}"] = float((c.outs[0].double() - ref).norm() / ref.norm())
        calls[lay] = [lambda i=i, pl=pl: call(pl, i) for i in range(c.sets)] * max(1, 10 // c.sets)
    times = {lay: [] for lay in LAYOUTS}
    for r in range(rounds):
        for lay in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            times[lay].append(time_graph(calls[lay], 60))
    for lay in LAYOUTS:
        row[f"us_{lay}"] = statistics.median(times[lay])
    row["runs"] = times
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="int8,rk4v4,rk4v4-e8")
    p.add_argument("--cases", default="32768:1,131072:1,524288:1,131072:8", help="context:batch pairs")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for geom in ((32, 8, 128), (24, 4, 256)):
        for fmt_name in a.formats.split(","):
            for cb in a.cases.split(","):
                ctx, bsz = (int(x) for x in cb.split(":"))
                row = case_rows(fmt_name, geom, ctx, bsz, a.rounds)
                rows.append(row)
                print(f"{fmt_name:9s} {row['geometry']:13s} ctx={ctx:6d} B={bsz}  " + "  ".join(
                    f"{lay} {row[f'us_{lay}']:8.2f} us ({row[f'us_{lay}'] / row['us_planes']:.3f}, "
                    f"err {row[f'rel_err_{lay}']:.1e})" for lay in LAYOUTS), flush=True)
                torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
