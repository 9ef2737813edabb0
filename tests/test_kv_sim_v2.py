"""Candidate v2 KV codecs (ninfer/bench/kv_sim_v2.py) against float64 brute force, and their hooks.

Each codec's output is taken apart again (rotated back, divided by scales found by brute force) and
checked to be the nearest point of its own grid: an E8 point within the 2^-8-grid bound of the exact
nearest (``brute_nearest``), the nearest e2m1 value under the nearest e4m3 scale, the 4-bit
asymmetric level of a per-group loop. The window attention is checked against a per-query loop."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ninfer.bench import kv_sim
from ninfer.bench import kv_sim_v2 as V
from ninfer.kvcache import e8
from ninfer.kvcache.hadamard import rotate
from tests.test_e8_codec import brute_nearest

GRID_SLACK = 2 * math.sqrt(8) * 2.0 ** -9  # |z - p| <= nearest + 2 |z - grid(z)|


def _data(seed: int, n: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g) * torch.rand(n, 1, generator=g) * 4
    x[:, 5] += 6.0 * seed  # an offset channel and a wide one, as real keys have
    x[:, 70] *= 1 + 3 * seed
    return x


def _check_e8(z: torch.Tensor, p: torch.Tensor) -> None:
    """p [..., 64k] (rotated code units of a codec's output) lies in E8 and the box and is the nearest
    point to the exact code units z, up to the 2^-8 grid."""
    zb = e8.to_blocks(z.double()).reshape(-1, 8)
    pb = e8.to_blocks(p.double()).reshape(-1, 8)
    r = torch.round(2 * pb)
    assert torch.allclose(2 * pb, r, atol=1e-4), "not on the half-integer grid"
    odd = r.remainder(2)
    assert bool((odd == odd[:, :1]).all()), "mixed cosets in one block"
    n = torch.where(odd[:, :1] == 1, (r - 1) / 2, r / 2)
    assert bool((n.sum(-1).remainder(2) == 0).all()) and float(r.min()) >= -16 and float(r.max()) <= 15
    best, _ = brute_nearest(zb.numpy())
    got = ((zb - pb) ** 2).sum(-1).sqrt().numpy()
    assert (got <= np.sqrt(best) + GRID_SLACK + 1e-4).all(), f"worst gap {(got - np.sqrt(best)).max()}"


@pytest.mark.parametrize("bits", [5, 6, 7])
def test_log2_scales_brute_force(bits: int) -> None:
    amax = torch.rand(200, 2, generator=torch.Generator().manual_seed(bits), dtype=torch.float64) * 40
    amax[:20, 1] *= 1e-3  # halves far apart: the offset clamps
    amax[20] = 0
    got = V.log2_scales(amax, bits)
    f = 2 ** (bits - 2)
    for i in range(amax.shape[0]):
        need = amax[i] / 8
        if float(need.max()) == 0:
            assert got[i].tolist() == [0.0, 0.0]
            continue
        base = next(b for b in range(-40, 40) if 2.0 ** b >= float(need.max()))
        table = [2.0 ** (base - o / f) for o in range(2 ** bits)]
        for h in range(2):
            want = min(s for s in table if s >= float(need[h]) * (1 - 1e-12))
            assert abs(float(got[i, h]) - want) <= 1e-12 * want


@pytest.mark.parametrize("seed,bits,a", [(0, 6, 1.0), (1, 7, 1.0), (2, 5, V.A)])
def test_log2s32_is_nearest_e8_under_its_scales(seed: int, bits: int, a: float) -> None:
    x = _data(seed)
    out = V.log2s32(x, bits, a)
    xr, orr = (e8.to_blocks(rotate(t).double()).reshape(16, 2, 2, 32) for t in (x, out))
    s = V.log2_scales(xr.abs().amax(-1), bits)[..., None]
    z, p = (e8.from_blocks((t / s).reshape(16, 2, 8, 8)) for t in (xr, orr))
    assert float(z.abs().max()) <= 8 + 1e-9
    _check_e8(8 * V.expand(z / 8, a), 8 * V.expand(p / 8, a))


def test_expand_inverts_the_compander() -> None:
    y = torch.linspace(-1, 1, 401, dtype=torch.float64)
    for a in (0.5, V.A, 0.9):
        lo, hi = torch.full_like(y, -1.5), torch.full_like(y, 1.5)
        for _ in range(80):  # bisection on the monotone cubic
            mid = (lo + hi) / 2
            up = V.compand(mid, a) > y
            hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
        assert torch.allclose(V.expand(y, a), (lo + hi) / 2, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_compand_codec_is_nearest_e8_of_companded_units(seed: int) -> None:
    from ninfer.kvcache.formats import group_scales
    x = _data(seed)
    xr = rotate(x)
    _, s = group_scales(xr, 8.0, round_up=True)
    z = (xr.reshape(16, 2, 64).double() / s.double()).reshape(16, 128)
    zq = (rotate(V.companded(x)).reshape(16, 2, 64).double() / s.double()).reshape(16, 128)
    u, p = 8 * V.expand(z / 8), 8 * V.expand(zq / 8)
    _check_e8(u, p)
    g = torch.randn(2048, 64, generator=torch.Generator().manual_seed(seed))
    shipped = kv_sim.format_codec("rk4v4-e8")(g)
    assert V.snr_db(g, V.companded(g)) > V.snr_db(g, shipped) + 0.3  # finer steps where N(0,1) is dense


def _e4m3_values() -> torch.Tensor:
    vals = [m / 8 * 2.0 ** -6 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(vals, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_brute_force(seed: int) -> None:
    x = _data(seed)
    xr = rotate(x).double()
    g = float(xr.abs().max()) / (6 * 448)
    b = xr.reshape(16, 8, 16)
    e4 = _e4m3_values()
    t = b.abs().amax(-1, keepdim=True) / 6 / g
    s = e4[(t[..., None] - e4).abs().argmin(-1)] * g
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    grid = torch.cat([-grid.flip(0), grid])
    y = b / s
    want = grid[(y[..., None] - grid).abs().argmin(-1)] * s
    got = rotate(V.nvfp4(x)).double().reshape(want.shape)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(xr.abs().max()))


@pytest.mark.parametrize("dim,group,n", [(-1, 64, 128), (-2, 64, 150), (-2, 64, 40)])
def test_asym4_against_a_group_loop(dim: int, group: int, n: int) -> None:
    x = torch.randn(2, n, 128, generator=torch.Generator().manual_seed(n)) * 3 + 1
    got = V.asym4(x, dim=dim, group=group)
    xt = x.movedim(dim, -1).numpy()
    want = np.empty_like(xt)
    for idx in np.ndindex(*xt.shape[:-1]):
        for a in range(0, xt.shape[-1], group):
            v = xt[idx][a:a + group]
            lo = np.float32(np.float16(v.min()))
            step = np.float32(np.float16((v.max() - lo) / np.float32(15)))
            q = np.clip(np.round((v - lo) / step), 0, 15) if step > 0 else np.zeros_like(v)
            want[idx][a:a + group] = lo + q * step
    assert np.allclose(got.movedim(dim, -1).numpy(), want, atol=1e-6)
    assert float((got - x).abs().max()) <= float(x.abs().max()) * 2 / 15  # half a step and fp16 rounding


def test_window_attention_against_a_query_loop() -> None:
    g = torch.Generator().manual_seed(0)
    q, kf, v = (torch.randn(1, h, 150, 64, generator=g) for h in (4, 2, 2))
    kq = kf + 0.3 * torch.randn(kf.shape, generator=g)

    class M:
        scaling = 0.125

    out, _ = V.Windowed(V.asym4, window=64).attend(M(), q, kq, kf, v)
    for t in range(150):
        keys = torch.where((torch.arange(t + 1) // 64 == t // 64)[:, None], kf[0, :, :t + 1], kq[0, :, :t + 1])
        keys, vals = keys.repeat_interleave(2, 0).double(), v[0, :, :t + 1].repeat_interleave(2, 0).double()
        w = torch.softmax((q[0, :, t].double()[:, None] * keys).sum(-1) * 0.125, -1)
        assert torch.allclose(out[0, t], (w[..., None] * vals).sum(1).float(), atol=1e-5)


def test_window_hook_keeps_recent_keys(kv_sim_model):
    """Within one 64-token block every key is in the window: K-only KL is 0 up to rounding; longer,
    the window lowers rk4v4-e8's K-only KL; kivi-nw quantizes every key."""
    _, m, tok = kv_sim_model
    doc = {"a": kv_sim.documents()["river"]}
    short, long = kv_sim.token_ids(tok, doc, 60), kv_sim.token_ids(tok, doc, 160)
    kl = lambda name, ids: kv_sim.doc_kl(  # noqa: E731
        m, ids, {k: kv_sim.log_probs(m, x) for k, x in ids.items()}, kv_sim.format_codec(name), planes="k")["a"]
    assert kl("v2:e8-w64", short) < 1e-9 < kl("v2:kivi-nw", short)
    assert kl("v2:kivi128", short) < 1e-9 < kl("v2:kivi128-nw", short)
    assert 0 < kl("v2:e8-w64", long) < kl("rk4v4-e8", long)
    assert kl("v2:kivi", long) > 0


def test_codec_names_and_bits():
    assert kv_sim.codec_names("rk4v4-e8+c, v2:log2s32-5+c,v2:kivi") == ["rk4v4-e8+c", "v2:log2s32-5+c", "v2:kivi"]
    for bad in ("v2:nope", "v2:kivi-p2"):
        with pytest.raises(ValueError, match="v2 codecs: "):
            kv_sim.codec_names(bad)
    assert V.bits("v2:log2s32-5+c") == (64 * 4 + 8 + 2 * 5) / 64 and V.bits("rk4v4-e8") == 4.25


def test_permuted_puts_the_channels_back():
    w = torch.arange(1.0, 129.0)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    got = V.permuted(lambda y: y * w, 2)(x)  # channel c of the codec's input is channel perm[c]
    assert torch.allclose(got, x * w.reshape(2, 64)[:, torch.argsort(perm)].reshape(128))
    e8p = V.codec("v2:e8-p1")
    assert V.snr_db(x, e8p(x)) > 18 and not torch.equal(e8p(x), V.codec("v2:e8")(x))
    assert torch.equal(V.codec("v2:e8")(x), kv_sim.format_codec("rk4v4-e8")(x))
    assert torch.equal(V.codec("v2:e8-refit")(x), kv_sim.e8_refit(x))
    assert V.codec("v2:kivi-p1") is None and V.bits("v2:compand-p3+c") == 4.25


def test_bench_kl_text_cli_v2_names(kv_sim_model, tmp_path, capsys):
    import json

    from ninfer.cli import main
    out = tmp_path / "kl.json"
    with pytest.raises(SystemExit, match="ninfer bench kl: unknown codec 'v2:kivi128-p1'"):
        main(["bench", "kl", str(kv_sim_model[0]), "--text", "--kv-dtype", "v2:kivi128-p1"])
    assert main(["bench", "kl", str(kv_sim_model[0]), "--text", "--kv-dtype", "v2:compand-log2s32-5,v2:e8-w16",
                 "--tokens", "40", "--json", str(out)]) == 0
    assert "| v2:e8-w16 | KV |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kv_dtype"], r["bits"]) for r in rows] == [("v2:compand-log2s32-5", 4.28125), ("v2:e8-w16", 4.25)]
    assert all(r["mean_kl"] > 0 for r in rows)
