"""KV format registry: names, planes, bytes/token, geometry line, encode/decode error bounds."""
from __future__ import annotations

import math

import pytest
import torch

from ninfer.kvcache import e8
from ninfer.kvcache.formats import FORMAT_NAMES, KVFormat, Plane, code_units, get_format, group_scales
from ninfer.kvcache.hadamard import h64, rotate, rotation_matrix, sign_pattern


def _snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(float((x * x).sum() / ((x - y) ** 2).sum()))


def test_names_and_refusals() -> None:
    assert FORMAT_NAMES == ("auto", "bf16", "int8", "rk4v4", "rk4v4-e8", "rk4v4-e8w")
    for n in FORMAT_NAMES:
        assert isinstance(get_format(n), KVFormat) and get_format(n).name == n
    with pytest.raises(ValueError, match="rk2v4-e8"):
        get_format("rk2v4-e8")
    with pytest.raises(ValueError) as ei:
        get_format("fp4")
    assert all(n in str(ei.value) for n in FORMAT_NAMES)


BYTES = {  # DESIGN 2 table: K + V per token per KV head
    ("bf16", 256): 1024, ("int8", 256): 528, ("rk4v4", 256): 272, ("rk4v4-e8", 256): 272,
    ("bf16", 128): 512, ("int8", 128): 264, ("rk4v4", 128): 136, ("rk4v4-e8", 128): 136,
    ("auto", 128): 512,
}


@pytest.mark.parametrize("name,d", sorted(BYTES))
def test_bytes_per_token(name: str, d: int) -> None:
    assert get_format(name).bytes_per_token_head(d) == BYTES[(name, d)]


def test_auto_follows_model_dtype_and_planes() -> None:
    assert get_format("auto").bytes_per_token_head(128, torch.float32) == 1024
    assert get_format("auto").planes(64, torch.float16) == (Plane("k", torch.float16, 64), Plane("v", torch.float16, 64))
    assert get_format("rk4v4-e8").planes(256, torch.bfloat16) == (
        Plane("k", torch.uint8, 128), Plane("k_scale", torch.float16, 4),
        Plane("v", torch.uint8, 128), Plane("v_scale", torch.float16, 4))
    assert get_format("int8").planes(128, torch.bfloat16)[0] == Plane("k", torch.int8, 128)
    with pytest.raises(ValueError):
        get_format("rk4v4").planes(96, torch.bfloat16)
    f = get_format("rk4v4-e8")
    assert (f.rotated, f.packed, f.e8_lattice, f.has_scales) == (True, True, True, True)
    f = get_format("int8")
    assert (f.rotated, f.packed, f.e8_lattice, f.has_scales) == (False, False, False, True)


def test_geometry_line() -> None:
    assert get_format("rk4v4-e8").geometry_line(256, torch.bfloat16) == (
        "kv planes: kv_dtype=rk4v4-e8 packed_k=1 packed_v=1 e8_lattice=1 e8_root=0 extent=256->128 "
        "dtype=uint8 scales=fp16x4")
    assert get_format("bf16").geometry_line(128, torch.bfloat16).endswith("extent=128->128 dtype=bfloat16 scales=none")
    f = get_format("rk4v4")
    good = {p.name: torch.empty(1, 2, 64, p.extent, dtype=p.dtype) for p in f.planes(128, torch.bfloat16)}
    assert f.geometry_line(128, torch.bfloat16, allocated=good) == f.geometry_line(128, torch.bfloat16)
    bad = dict(good, k=torch.empty(1, 2, 64, 128, dtype=torch.uint8))  # full-width plane: must not pass
    with pytest.raises(RuntimeError):
        f.geometry_line(128, torch.bfloat16, allocated=bad)


def test_hadamard_orthonormal_self_inverse() -> None:
    h = h64(torch.float64)
    assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(64, dtype=torch.float64))
    assert set(h.abs().unique().tolist()) == {0.125}
    assert h[1, 0] == 0.125 and h[1, 1] == -0.125 and h[3, 3] == 0.125  # Sylvester natural order
    r = rotation_matrix(torch.float64)  # R = S.H.S with the bent sign pattern
    sg = sign_pattern(torch.float64)
    assert torch.equal(r, sg[:, None] * h * sg[None, :]) and torch.equal(r, r.T)
    assert torch.allclose(r @ r, torch.eye(64, dtype=torch.float64))
    assert sg[:4].tolist() == [1, 1, 1, -1] and torch.equal((h @ sg).abs(), torch.ones(64, dtype=torch.float64))
    assert torch.equal(rotate(torch.ones(1, 64, dtype=torch.float64)).abs(), torch.full((1, 64), 1.0, dtype=torch.float64))
    x = torch.randn(3, 5, 256, dtype=torch.float64)
    assert torch.allclose(rotate(x), (x.reshape(3, 5, 4, 64) @ r).reshape(3, 5, 256))
    assert torch.allclose(rotate(rotate(x)), x)
    q = torch.randn(256, dtype=torch.float64)
    assert torch.allclose(rotate(q) @ rotate(x).transpose(-1, -2), q @ x.transpose(-1, -2))
    with pytest.raises(ValueError):
        rotate(torch.zeros(4, 100))


def _gauss(rows: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_int8_error_bound() -> None:
    x = _gauss(512, 128, 0, torch.float64) * 3
    f = get_format("int8")
    data, s = f.encode(x)
    assert data.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (512, 2)
    amax = x.reshape(512, 2, 64).abs().amax(-1)
    assert torch.equal(s, (amax.float() / 127).half())  # represented fp16 scale, not rotated
    err = (f.decode(data, s, dtype=torch.float64) - x).reshape(512, 2, 64).abs()
    assert bool((err <= 0.5 * s.double()[..., None] * (1 + 1e-3)).all())
    assert _snr_db(x, f.decode(data, s, dtype=torch.float64)) > 40


def test_rk4v4_error_bound() -> None:
    x = _gauss(1024, 256, 1, torch.float64)
    f = get_format("rk4v4")
    data, s = f.encode(x)
    assert data.shape == (1024, 128) and data.dtype == torch.uint8
    xr = rotate(x)
    err = (f.decode(data, s, rotated=True, dtype=torch.float64) - xr).reshape(1024, 4, 64).abs()
    z = xr.reshape(1024, 4, 64) / s.double()[..., None]
    bound = torch.where(z > 7.5, z - 7, torch.full_like(z, 0.5)) * s.double()[..., None] * (1 + 1e-5) + 1e-9
    assert bool((err <= bound).all())
    snr = _snr_db(x, f.decode(data, s, dtype=torch.float64))
    assert 19.5 < snr < 20.6, snr


def test_rk4v4_e8_quality_and_exact_points() -> None:
    x = _gauss(1024, 256, 2, torch.float64)
    f, scalar = get_format("rk4v4-e8"), get_format("rk4v4")
    data, s = f.encode(x)
    y = f.decode(data, s, dtype=torch.float64)
    snr = _snr_db(x, y)
    assert snr >= 20.8 and snr - _snr_db(x, scalar.decode(*scalar.encode(x), dtype=torch.float64)) >= 0.6, snr
    # rotated-domain codes are exactly the nearest E8 points of z = Hx / s rounded to the 2^-8 grid
    z = rotate(x).float().reshape(1024, 4, 64) / s.float()[..., None]
    zg = code_units(rotate(x).float(), s.float()[..., None], e8.GRID).reshape(1024, 4, 64)
    assert float((zg - z).abs().max()) <= 2.0**-9 + 1e-5 and bool((zg * 256 == (zg * 256).round()).all())
    n, c = e8.e8_nearest(e8.to_blocks(zg.reshape(1024, 256)))
    assert torch.equal(e8.encode_e8(e8.from_blocks(e8.e8_point(n, c))), data)
    # decode(rotated=False) is H applied to decode(rotated=True); bf16 output works
    yr = f.decode(data, s, rotated=True, dtype=torch.float64)
    assert torch.allclose(rotate(yr), y, atol=1e-5)
    assert f.decode(data, s, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["int8", "rk4v4", "rk4v4-e8"])
def test_reencode_with_stored_scale_is_idempotent(name: str) -> None:
    f = get_format(name)
    x = _gauss(64, 128, 3) * 5
    data, s = f.encode(x)
    vals = f.decode(data, s, rotated=True)  # s * code, in the stored domain
    z = (vals.reshape(64, 2, 64) / s.float()[..., None]).reshape(64, 128)
    again = e8.encode_e8(z) if f.e8_lattice else (e8.encode_scalar4(z) if f.packed else z.round().to(torch.int8))
    assert torch.equal(again, data)


@pytest.mark.parametrize("name", ["int8", "rk4v4", "rk4v4-e8"])
def test_zero_groups_exact_and_bad_input(name: str) -> None:
    f = get_format(name)
    x = _gauss(8, 128, 4)
    x[:, 64:] = 0.0
    data, s = f.encode(x)
    assert bool((s[:, 1] == 0).all())
    y = f.decode(data, s)
    if not f.rotated:
        assert bool((y[:, 64:] == 0).all())
    assert bool((f.decode(data, s, rotated=True)[:, 64:] == 0).all())
    assert torch.equal(f.decode(*f.encode(torch.zeros(2, 128))), torch.zeros(2, 128))
    for bad in (float("nan"), float("inf"), -float("inf")):
        xb = x.clone()
        xb[3, 5] = bad
        with pytest.raises(ValueError, match="NaN/Inf"):
            f.encode(xb)
    with pytest.raises(ValueError, match="fp16"):
        f.encode(torch.full((1, 128), 1e9))
    tiny = torch.full((1, 128), 1e-10)  # scale underflows fp16: clamped to 2^-24, still decodes
    y = f.decode(*f.encode(tiny))
    assert bool(torch.isfinite(y).all()) and float((y - tiny).abs().max()) < 1e-7


def test_scale_uses_represented_fp16() -> None:
    x = _gauss(16, 64, 5) * 1.7
    s16, s = group_scales(x, 8.0)
    assert torch.equal(s16, (x.abs().amax(-1, keepdim=True) / 8.0).half())
    assert torch.equal(s[..., 0], s16.float())


def test_4bit_scale_rounds_up_so_code_units_stay_in_the_box() -> None:
    """The 4-bit rule: s is the smallest fp16 >= absmax / 8, so every code unit lies in [-8, 8],
    also where s is an fp16 subnormal; nearest rounding leaves the box there (the check can fail)."""

    x = _gauss(512, 64, 8) * torch.exp2(torch.randint(-40, 6, (512, 1), generator=torch.Generator().manual_seed(8)))
    raw = x.abs().amax(-1, keepdim=True) / 8.0
    s16, s = group_scales(x, 8.0, round_up=True)
    below = (s16.view(torch.int16) - 1).view(torch.float16).float()
    assert bool((s16.float() >= raw).all()) and bool((below < raw).all())
    assert float(code_units(x, s).abs().max()) <= 8.0
    assert float(code_units(x, s, e8.GRID).abs().max()) <= 8.0  # the rk4v4-e8 grid: also in the box
    _, s_rn = group_scales(x, 8.0)
    assert float(code_units(x, s_rn).abs().max()) > 8.5  # subnormal scales rounded to nearest


def test_unquantized_formats() -> None:
    x = _gauss(4, 128, 6, torch.bfloat16)
    d, s = get_format("auto").encode(x)
    assert s is None and torch.equal(d, x)
    d, s = get_format("bf16").encode(x.float())
    assert s is None and d.dtype == torch.bfloat16 and torch.equal(get_format("bf16").decode(d, None), x.float())


def test_bench_codec_json_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json

    from ninfer.bench import codec

    p = argparse.ArgumentParser()
    codec.add_arguments(p)
    assert codec.run(p.parse_args(["--json", "--samples", "64"])) == 0
    out = json.loads(capsys.readouterr().out)
    snr = out["snr_db"]
    assert set(FORMAT_NAMES) <= set(snr) and "ref:seed-collapsed-e8" in snr and "ref:turboquant-lm16" in snr
    assert snr["rk4v4-e8"]["bits_per_value"] == 4.25 and snr["int8"]["bits_per_value"] == 8.25
    assert snr["rk4v4-e8"]["gauss"] > snr["rk4v4"]["gauss"] > snr["ref:seed-collapsed-e8"]["gauss"]
    assert abs(snr["bound:shannon@4"]["gauss"] - 24.08) < 1e-9


def test_bench_codec_model_per_head(tiny_checkpoint, capsys: pytest.CaptureFixture[str]) -> None:
    """--model: real K/V from transformers' cache, pooled and per (layer, KV head); every head of a
    random-weight model is near-Gaussian after the rotation, so each sits near the gauss figures."""
    import argparse
    import json
    from ninfer.bench import codec
    path = tiny_checkpoint(kv_heads=2, heads=4, head_dim=64)
    p = argparse.ArgumentParser()
    codec.add_arguments(p)
    assert codec.run(p.parse_args(["--json", "--samples", "256", "--model", str(path)])) == 0
    out = json.loads(capsys.readouterr().out)
    heads = out["per_head_snr_db"]
    assert set(heads) == {"model-k", "model-v"}
    assert sorted(heads["model-k"]) == ["L0H0", "L0H1", "L1H0", "L1H1"]
    for rows in heads.values():
        for r in rows.values():
            assert r["int8"] > 38 and 19.5 < r["rk4v4"] < r["rk4v4-e8"] < 22.5, r
    assert out["values"]["model-k"] == 2 * 2 * 128 * 64  # layers x heads x tokens x head_dim
