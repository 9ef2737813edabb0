"""E8 codec: exact nearest point in the box (brute force), packing bit-exactness, layout."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ninfer.kvcache import e8

# ---------------------------------------------------------------- brute force (independent)
_COMBOS3 = np.array(list(itertools.product(range(3), repeat=8)), dtype=np.int64)  # [6561, 8]
_BOX = np.arange(-8, 8, dtype=np.float64)


def brute_nearest(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact min distance^2 per block over E8 ∩ box (float64), and per coset [N, 2].

    For each coset, per coordinate the 3 in-box integers nearest to y = z - c/2 (by sorting the
    whole box), then every combination of those with an even sum."""
    z = np.asarray(z, dtype=np.float64)
    per_coset = []
    for c in (0, 1):
        y = z - 0.5 * c
        order = np.argsort(np.abs(y[..., None] - _BOX), axis=-1, kind="stable")[..., :3]
        cand = _BOX[order]  # [N, 8, 3]
        cost = (y[..., None] - cand) ** 2
        d = np.zeros((len(z), len(_COMBOS3)))
        par = np.zeros((len(z), len(_COMBOS3)), dtype=np.int64)
        for i in range(8):  # every combination: sum of per-coordinate costs and parities
            d += cost[:, i, _COMBOS3[:, i]]
            par += cand[:, i, _COMBOS3[:, i]].astype(np.int64)
        even = (par % 2) == 0
        per_coset.append(np.where(even, d, np.inf).min(-1))
    dc = np.stack(per_coset, -1)
    return dc.min(-1), dc


def _dist(z: torch.Tensor, n: torch.Tensor, c: torch.Tensor) -> np.ndarray:
    p = e8.e8_point(n, c, torch.float64).numpy()
    return ((z.double().numpy() - p) ** 2).sum(-1)


def _check_nearest(z: torch.Tensor, tol: float = 1e-5) -> None:
    n, c = e8.e8_nearest(z)
    assert n.min() >= -8 and n.max() <= 7
    assert bool(((n.sum(-1) % 2) == 0).all()), "sum(n) must be even"
    best, _ = brute_nearest(z.numpy())
    got = _dist(z, n, c)
    gap = got - best
    assert gap.max() <= tol * np.maximum(1.0, best).max(), f"not nearest: worst gap {gap.max()}"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_inputs_are_nearest(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scale = [1.0, 3.0, 6.0, 10.0][seed]
    z = torch.randn(300, 8, generator=g) * scale
    _check_nearest(z)


def test_box_edges_and_beyond() -> None:
    g = torch.Generator().manual_seed(7)
    edges = torch.tensor([-100.0, -9.0, -8.5, -8.25, -8.0, -7.75, -7.5, -7.25, 6.75, 7.0, 7.25, 7.5, 7.75, 8.0, 8.5, 100.0])
    z = edges[torch.randint(0, len(edges), (300, 8), generator=g)]
    mix = torch.randn(300, 8, generator=g) * 4
    keep = torch.rand(300, 8, generator=g) < 0.5
    _check_nearest(torch.where(keep, z, mix))
    # all coordinates far outside: inward neighbours only
    n, c = e8.e8_nearest(torch.full((1, 8), 1e6))
    assert e8.e8_point(n, c).tolist() == [[7.5] * 8]
    n, c = e8.e8_nearest(torch.full((1, 8), -1e6))
    assert e8.e8_point(n, c).tolist() == [[-8.0] * 8]


def test_ties_are_nearest_and_deterministic() -> None:
    g = torch.Generator().manual_seed(11)
    z = torch.randint(-36, 36, (400, 8), generator=g).float() / 4  # quarter grid: exact arithmetic, many ties
    _check_nearest(z, tol=0.0)
    n, c = e8.e8_nearest(z)
    _, dc = brute_nearest(z.numpy())
    tie = dc[:, 0] == dc[:, 1]
    assert tie.any() and bool((c[torch.from_numpy(tie)] == 0).all()), "coset ties keep the integer coset"
    n2, c2 = e8.e8_nearest(z.clone())
    assert torch.equal(n, n2) and torch.equal(c, c2)


def test_documented_tie_rules() -> None:
    # equidistant cosets (0 vs all-1/2): integer coset wins
    n, c = e8.e8_nearest(torch.full((1, 8), 0.25))
    assert c.item() == 0 and n.abs().sum().item() == 0
    # parity fix: two equally cheap coordinates -> the lower position moves
    n, c = e8.e8_nearest(torch.tensor([[0.375, 0.375, 0, 0, 0, 0, 0, 1.0]]))
    assert c.item() == 0 and n.tolist() == [[1, 0, 0, 0, 0, 0, 0, 1]]
    # at the box edges the move is inward (7 -> 6, -8 -> -7); equal costs -> lowest position
    n, _, _ = e8.coset_candidates(torch.tensor([[7.625] * 7 + [-8.625]]))
    assert n.tolist() == [[6, 7, 7, 7, 7, 7, 7, -8]]
    n, _, _ = e8.coset_candidates(torch.tensor([[-8.625] + [7.625] * 7]))
    assert n.tolist() == [[-7, 7, 7, 7, 7, 7, 7, 7]]
    # the half coset: -7.5 -> -6.5 and 7.5 -> 6.5 (n1 = -8 -> -7, 7 -> 6)
    _, n1, _ = e8.coset_candidates(torch.tensor([[-7.75] * 7 + [7.9], [7.75] * 7 + [-7.9]]))
    assert n1.tolist() == [[-7, -8, -8, -8, -8, -8, -8, 7], [6, 7, 7, 7, 7, 7, 7, -8]]
    # exact half: rint rounds half to even
    n, c = e8.e8_nearest(torch.tensor([[2.5, 3.5, 0, 0, 0, 0, 0, 0]]))
    assert c.item() == 0 and n.tolist() == [[2, 4, 0, 0, 0, 0, 0, 0]]


def test_exact_lattice_points_are_fixed() -> None:
    g = torch.Generator().manual_seed(5)
    n = torch.randint(-8, 8, (2000, 8), generator=g, dtype=torch.int32)
    n[:, 7] = torch.where(n[:, :7].sum(-1) % 2 == 0, n[:, 7] & ~1, n[:, 7] | 1)
    c = torch.randint(0, 2, (2000,), generator=g, dtype=torch.int32)
    n2, c2 = e8.e8_nearest(e8.e8_point(n, c))
    assert torch.equal(n, n2) and torch.equal(c, c2)


def _packed_roundtrip_z(rows: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d, generator=g) * 3


def test_encode_decode_encode_idempotent_and_points_in_e8() -> None:
    z = _packed_roundtrip_z(256, 256, 3)
    data = e8.encode_e8(z)
    assert data.dtype == torch.uint8 and data.shape == (256, 128)
    p = e8.decode_e8(data)
    assert torch.equal(e8.encode_e8(p), data)
    blocks = e8.to_blocks(p)  # [..., G, 8, 8] -> every block an E8 point in the box
    frac = blocks - blocks.floor()
    same = (frac == frac[..., :1]).all(-1)
    assert bool(same.all()) and bool(((frac == 0) | (frac == 0.5)).all())
    n = blocks - frac
    assert bool(((n.sum(-1).long() % 2) == 0).all())
    assert blocks.min() >= -8 and blocks.max() <= 7.5
    # decoded point equals the nearest point computed directly
    nn, cc = e8.e8_nearest(e8.to_blocks(z))
    assert torch.equal(e8.from_blocks(e8.e8_point(nn, cc)), p)


def test_coset_bit_survives_every_nibble_value() -> None:
    g = torch.Generator().manual_seed(4)
    n_all, c_all = [], []
    for v in range(-8, 8):  # every value of n7 (hence every nibble 7), with both coset bits
        for c in (0, 1):
            n = torch.randint(-8, 8, (8, 8), generator=g, dtype=torch.int32)
            n[:, 7] = v
            odd = (n.sum(-1) % 2) == 1
            n[:, 6] = torch.where(odd, torch.where(n[:, 6] > -8, n[:, 6] - 1, n[:, 6] + 1), n[:, 6])
            n_all.append(n)
            c_all.append(torch.full((8,), c, dtype=torch.int32))
    n, c = torch.cat(n_all), torch.cat(c_all)
    assert bool(((n.sum(-1) % 2) == 0).all()) and n.min() >= -8 and n.max() <= 7
    blocks = torch.zeros(len(n), 1, 8, 8)
    blocks[:, 0, 3, :] = e8.e8_point(n, c)  # block w = 3 of a 64-group
    data = e8.encode_e8(e8.from_blocks(blocks))
    n2, c2 = e8.decode_e8_blocks(data)
    assert torch.equal(n2[:, 0, 3], n) and torch.equal(c2[:, 0, 3], c)
    assert set((e8.unpack_nibbles(data)[:, 0, 3, 7]).tolist()) == set(range(16))


def test_nibble_layout_bit_exact() -> None:
    d = 128
    for coord in (0, 1, 7, 8, 9, 63, 64, 64 + 8 * 5 + 3, 127):
        z = torch.zeros(1, d)
        z[0, coord] = 3.0
        data = e8.encode_scalar4(z)
        g, r = divmod(coord, 64)
        j, w = divmod(r, 8)
        words = data.numpy().view("<u4")[0]  # little-endian uint32 words
        expect = np.full(d // 8, 0x88888888, dtype=np.uint32)
        expect[8 * g + w] = np.uint32(0x88888888 & ~(0xF << (4 * j)) | (11 << (4 * j)))
        assert np.array_equal(words, expect), coord
        # byte view: low nibble = even j, high nibble = odd j
        b = data[0, 32 * g + 4 * w + j // 2].item()
        assert ((b >> 4) if j % 2 else (b & 0xF)) == 11


def test_coset_bit_position_in_word() -> None:
    blocks = torch.zeros(1, 1, 8, 8)
    blocks[0, 0, 5, :] = 0.5  # block w = 5 is the point (1/2)^8: n = 0, c = 1
    data = e8.encode_e8(e8.from_blocks(blocks))
    words = data.numpy().view("<u4")[0]
    assert words[5] == 0x88888888 | (1 << 28)
    assert all(words[w] == 0x88888888 for w in range(8) if w != 5)


def test_pack_unpack_bit_exact_random_bytes() -> None:
    g = torch.Generator().manual_seed(9)
    data = torch.randint(0, 256, (64, 96), generator=g, dtype=torch.uint8)
    u = e8.unpack_nibbles(data)
    assert u.shape == (64, 3, 8, 8) and torch.equal(e8.pack_nibbles(u), data)
    # scalar codec: decode -> encode reproduces any byte string
    assert torch.equal(e8.encode_scalar4(e8.decode_scalar4(data)), data)
    # E8 codec: decode -> encode reproduces any byte string (every 32-bit word is a valid code)
    assert torch.equal(e8.encode_e8(e8.decode_e8(data)), data)


def test_layout_helpers_inverse() -> None:
    x = torch.arange(2 * 192).reshape(2, 192)
    b = e8.to_blocks(x)
    assert b[0, 1, 3, 5].item() == 64 + 8 * 5 + 3
    assert torch.equal(e8.from_blocks(b), x)
    with pytest.raises(ValueError):
        e8.to_blocks(torch.zeros(3, 96))


# ---------------------------------------------------------------- the scale refit (rk4v4-e8's encoder)
def _pipeline(seed: int, n: int = 2048):
    from ninfer.kvcache.formats import code_units, group_scales
    from ninfer.kvcache.hadamard import rotate

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[: n // 8, 5] *= 30  # an outlier channel
    x[n // 8: n // 8 + 3] = 0.0  # all-zero groups
    xr = rotate(x)
    s16, s = group_scales(xr, 8.0, round_up=True)
    return xr, s16, s[..., 0], code_units(xr, s, e8.GRID)


def _sq_err(xr: torch.Tensor, data: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    p = e8.decode_e8(data, torch.float64)
    y = p.reshape(*p.shape[:-1], -1, 64) * s.double()[..., None]
    return ((xr.double().reshape(y.shape) - y) ** 2).sum(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refit_never_worse_and_least_squares(seed: int) -> None:
    """Against float64 brute force: the refit's decoded error is never above the first encoder's
    (beyond the 2^-9 code-unit grid), lower on average; a kept point set carries the fp16 scale
    nearest to its least-squares optimum <x, p> / <p, p> (computed here in float64 from x itself)."""
    xr, s16, s0, z0 = _pipeline(seed)
    data, s = e8.encode_e8_refit(z0, s0)
    xt = (z0.double().reshape(*z0.shape[:-1], -1, 64) * s0.double()[..., None]).reshape(z0.shape)
    for x, tol in ((xt, 1e-6), (xr, 2e-3)):  # x~ = s0 z0, what the encoder fits; x itself
        base = _sq_err(x, e8.encode_e8(z0), s0)
        new = _sq_err(x, data, s.float())
        assert bool((new <= base * (1 + tol) + 1e-30).all())
        assert float(new.sum()) < 0.985 * float(base.sum())
    p = e8.decode_e8(data, torch.float64).reshape(*xr.shape[:-1], -1, 64)
    live = s0 > 0
    # x~ = s0 z0 (what the encoder fits: x on the 2^-9 code-unit grid) and x itself
    for xg, want in ((z0.double().reshape(p.shape) * s0.double()[..., None], 0.999), (xr.double().reshape(p.shape), 0.9)):
        opt = (xg * p).sum(-1) / (p * p).sum(-1).clamp_min(1e-300)
        lo = hi = opt.float().half().double()  # the two fp16 neighbours of the optimum
        lo = torch.where(lo > opt, torch.nextafter(lo.half(), torch.tensor(0.0).half()).double(), lo)
        hi = torch.where(hi < opt, torch.nextafter(hi.half(), torch.tensor(1e4).half()).double(), hi)
        nearest = torch.where((opt - lo) <= (hi - opt), lo, hi)
        close = (s.double() == nearest) | (((opt - lo) - (hi - opt)).abs() < 1e-3 * (hi - lo))
        assert float(close[live].float().mean()) > want
    assert bool((s[~live] == 0).all()) and bool((e8.decode_e8(data)[xr.abs().sum(-1) == 0] == 0).all())


def test_refit_moves_scales_and_points_and_checks_shapes() -> None:
    xr, s16, s0, z0 = _pipeline(5)
    data, s = e8.encode_e8_refit(z0, s0)
    assert float((s != s16).float().mean()) > 0.5
    assert bool((data != e8.encode_e8(z0)).any())
    with pytest.raises(ValueError, match="do not match"):
        e8.encode_e8_refit(z0, s0[:, :1])


def test_refit_subnormal_and_edge_scales() -> None:
    """fp16-subnormal first scales (2^-24 .. 2^-15) and box-edge code units: the refit stays a valid
    fp16 >= 0, decodes finite, and never loses to the first encoder."""
    g = torch.Generator().manual_seed(9)
    z = torch.randint(-32, 33, (512, 64), generator=g).float() / 4
    z[:64] = torch.tensor([8.0, -8.0, 7.5, -7.5] * 16)
    s0 = torch.exp2(torch.randint(-24, -14, (512, 1), generator=g).float()).half().float()
    data, s = e8.encode_e8_refit(z, s0)
    assert bool(torch.isfinite(s.float()).all()) and bool((s.float() >= 0).all())
    xr = z * s0
    assert bool((_sq_err(xr, data, s.float()) <= _sq_err(xr, e8.encode_e8(z), s0) * (1 + 1e-6) + 1e-30).all())
