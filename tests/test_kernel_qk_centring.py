"""Key centring fused into qk_norm_rope (ninfer/kernels/qk_norm_rope.py) vs the unfused path: the
kernel without the transform, then ``KeyTransform`` (ninfer/kvcache/centering.py) in torch.

Interpreter: the checks run in one child process with ``TRITON_INTERPRET=1`` (tests/triton_interp.py).

What a case checks:
* fused == unfused bit for bit (the kernel rounds q * s and (k - m) * (1/s) where torch's ops do);
  without a q/k norm also == the whole torch path (apply_rotary, then KeyTransform), bit for bit;
* the shift and scale differ per (head, channel): the result taken with the statistics of the
  neighbouring kv head (or with the channels reversed) must differ, so a transform applied to the
  wrong head or channel fails the bitwise check;
* Qwen3.5's offset norm (x_hat * (1 + w), one rounding) vs OffsetRMSNorm + apply_rotary within the
  norm's bound (tests/test_kernel_fused_ops.py says why the norm is not bit-exact);
* inputs are strided views as the layers pass them (q/k split from the qkv output; Qwen3.5's q a
  half of each head's [query | gate]); D 64/128, GQA 1 and 4, partial rotary, bf16/fp16/fp32;
* both layers (dense Attention with q/k norm, Qwen3.5 GatedAttention) with a transform installed
  launch the kernel once with the transform and match their torch path.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.triton_interp import case_result, child_main, module_results  # noqa: E402

# (name, kind, dtype, params, seed); norm: 0 none, 1 q/k RMSNorm, 2 offset RMSNorm
CASES = []
for _dt in ("bfloat16", "float16", "float32"):
    for _t, _hq, _hkv, _d, _f, _norm, _s in ((3, 4, 4, 64, 1.0, 0, 40), (5, 8, 2, 128, 1.0, 1, 41),
                                             (2, 4, 1, 64, 0.5, 2, 42), (4, 2, 2, 128, 1.0, 1, 43)):
        CASES.append((f"centre-{_dt}-t{_t}-q{_hq}-kv{_hkv}-d{_d}-r{_f}-norm{_norm}", "centre", _dt,
                      dict(t=_t, hq=_hq, hkv=_hkv, d=_d, frac=_f, norm=_norm), _s))
for _s in (50, 51, 52):  # more seeds of the Qwen3-8B-like geometry (GQA 4, D 128)
    CASES.append((f"centre-bfloat16-seed{_s}", "centre", "bfloat16",
                  dict(t=3, hq=8, hkv=2, d=128, frac=1.0, norm=1), _s))
for _dt in ("bfloat16", "float32"):
    CASES.append((f"offset-{_dt}-d64-r0.25", "offset", _dt, dict(t=5, hq=4, hkv=2, d=64, frac=0.25, norm=2), 60))
    CASES.append((f"offset-{_dt}-d128", "offset", _dt, dict(t=3, hq=4, hkv=1, d=128, frac=1.0, norm=2), 61))
LAYER_CASES = [("layer-dense-float32", "layer", "float32", dict(arch="dense"), 70),
               ("layer-gated-float32", "layer", "float32", dict(arch="gated"), 71),
               ("layer-dense-bfloat16", "layer", "bfloat16", dict(arch="dense"), 72)]
CASES += LAYER_CASES


def _inputs(dt, p, seed, dev="cpu"):
    """q, k as the layer's strided views, cos/sin of large positions, norm weights, and a
    KeyTransform with distinct statistics per (kv head, channel)."""
    import torch

    from ninfer.kvcache.centering import KeyTransform
    from ninfer.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    t, hq, hkv, d = p["t"], p["hq"], p["hkv"], p["d"]
    rope = RotaryEmbedding(d, {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": p["frac"]}, 16384)
    cos, sin = rope.cos_sin(torch.randint(0, 120_000, (t,), generator=gen))
    if p["norm"] == 2:  # Qwen3.5: q is the first half of each head's [query | gate] of the qkv output
        qkv = (torch.randn(t, (2 * hq + 2 * hkv) * d, generator=gen) * 2).to(dt)
        q = qkv[:, :2 * hq * d].reshape(t, hq, 2 * d)[:, :, :d]
        k = qkv[:, 2 * hq * d:(2 * hq + hkv) * d].reshape(t, hkv, d)
    else:
        qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2).to(dt)
        q = qkv[:, :hq * d].reshape(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    w = None
    if p["norm"]:
        off = 0.0 if p["norm"] == 2 else 1.0
        w = [(off + 0.3 * torch.randn(d, generator=gen)).to(dt) for _ in range(2)]
    shift = (torch.randn(hkv, d, generator=gen) * 1.5).to(dt)
    scale = (2.0 ** (torch.rand(hkv, d, generator=gen) * 4 - 2)).to(dt)
    to = lambda x: x.to(dev)  # noqa: E731
    return (to(q), to(k), to(cos), to(sin), w and [to(x) for x in w],
            KeyTransform(to(shift), to(scale), hq))


def _run_centre(name, dt, p, seed, dev="cpu"):
    import torch

    from ninfer.kernels.qk_norm_rope import qk_norm_rope
    from ninfer.kvcache.centering import KeyTransform
    from ninfer.layers.rotary import apply_rotary
    from tests.test_kernel_fused_ops import _compare, _guards_ok, _poisoned

    q, k, cos, sin, w, tf = _inputs(dt, p, seed, dev)
    wq, wk = w if w else (None, None)
    off = p["norm"] == 2
    (bq, q_out), (bk, k_out) = (_poisoned(x.shape, x.dtype) for x in (q, k))
    if dev != "cpu":
        bq, q_out, bk, k_out = (x.to(dev) for x in (bq, q_out, bk, k_out))
        q_out, k_out = bq[1:-1], bk[1:-1]
    gq, gk = qk_norm_rope(q, k, cos, sin, wq, wk, 1e-6, offset_norm=off, q_out=q_out, k_out=k_out,
                          **tf.fused_args())
    plain = qk_norm_rope(q, k, cos, sin, wq, wk, 1e-6, offset_norm=off)
    rq, rk = tf(*plain)
    res = {"name": name, **_compare(gq, rq, "q"), **_compare(gk, rk, "k"),
           "guards": _guards_ok(bq) and _guards_ok(bk), "wrote_into_out": gq is q_out and gk is k_out}
    if not p["norm"]:  # no freedom anywhere: the whole torch path, bit for bit
        tq, tk = tf(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
        res.update(torch_q_equal=bool(torch.equal(gq, tq)), torch_k_equal=bool(torch.equal(gk, tk)))
    # statistics of the wrong head (rolled by one kv head; reversed channels when there is one head)
    wrong = (lambda x: x.roll(1, 0)) if tf.shift.shape[0] > 1 else (lambda x: x.flip(-1))
    bad = KeyTransform(wrong(tf.shift), 1.0 / wrong(tf.key_scale), q.shape[1])
    res["wrong_stats_differ"] = not torch.equal(bad(*plain)[1], gk)
    return res


def _run_offset(name, dt, p, seed, dev="cpu"):
    from ninfer.kernels.qk_norm_rope import qk_norm_rope
    from ninfer.layers.norm import OffsetRMSNorm
    from ninfer.layers.rotary import apply_rotary
    from tests.test_kernel_fused_ops import _compare

    q, k, cos, sin, (wq, wk), _ = _inputs(dt, p, seed, dev)
    qn, kn = OffsetRMSNorm(p["d"], 1e-6).to(dev), OffsetRMSNorm(p["d"], 1e-6).to(dev)
    qn.weight.data, kn.weight.data = wq.clone(), wk.clone()
    gq, gk = qk_norm_rope(q, k, cos, sin, wq, wk, 1e-6, offset_norm=True)
    return {"name": name, **_compare(gq, apply_rotary(qn(q), cos, sin), "q"),
            **_compare(gk, apply_rotary(kn(k), cos, sin), "k")}


def _layer(arch, dt, seed):
    import torch
    from types import SimpleNamespace

    from ninfer.kvcache.centering import KeyTransform
    from ninfer.layers.attention import Attention
    from ninfer.models.qwen3_5 import GatedAttention

    torch.manual_seed(seed)
    if arch == "dense":
        mod = Attention(48, 4, 1, 64, kv_layer=0, qkv_bias=True, o_bias=False, qk_norm=True, eps=1e-6)
    else:
        mod = GatedAttention(SimpleNamespace(hidden_size=48, head_dim=64, num_heads=4, num_kv_heads=2,
                                             attention_bias=False, rms_norm_eps=1e-6), kv_layer=0)
    with torch.no_grad():
        for prm in mod.parameters():
            prm.copy_(torch.randn(prm.shape) * (0.3 if prm.ndim > 1 else 0.2) + (1.0 if prm.ndim == 1 else 0.0))
    mod = mod.to(dt).eval()
    hkv = mod.num_kv_heads
    mod.key_transform = KeyTransform((torch.randn(hkv, 64) * 0.5).to(dt),
                                     (2.0 ** (torch.rand(hkv, 64) * 2 - 1)).to(dt), mod.num_heads)
    return mod


def _run_layer(name, dt, p, seed):
    import torch

    from ninfer.layers import attention, fused
    from ninfer.layers.rotary import RotaryEmbedding
    from ninfer.models import qwen3_5

    mod = _layer(p["arch"], dt, seed)
    owner = attention if p["arch"] == "dense" else qwen3_5
    seen = []

    class Capture:  # the backend: keeps what the layer hands it (the transformed q and k)
        name = "capture"

        def forward(self, layer, q, k, v, meta, scale):
            seen.append((q.clone(), k.clone()))
            return q

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 48, generator=gen).to(dt)
    cos, sin = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 1e4}, 4096).cos_sin(torch.arange(5))
    orig, saved, calls = owner.qk_norm_rope, fused.use_fused_kernels, []

    def spy(*a, **kw):
        calls.append(sorted(k for k in kw if k in ("q_scale", "k_shift", "k_scale")))
        return orig(*a, **kw)
    with torch.no_grad():
        ref = mod(x, cos, sin, None, Capture())
        fused.use_fused_kernels, owner.qk_norm_rope = (lambda t: True), spy
        try:
            got = mod(x, cos, sin, None, Capture())
        finally:
            fused.use_fused_kernels, owner.qk_norm_rope = saved, orig
    (rq, rk), (gq, gk) = seen
    scale = lambda a: float(a.float().abs().max())  # noqa: E731
    return {"name": name, "calls": calls, "q_err": float((gq.float() - rq.float()).abs().max()) / scale(rq),
            "k_err": float((gk.float() - rk.float()).abs().max()) / scale(rk),
            "out_err": float((got.float() - ref.float()).abs().max()) / scale(ref)}


def _run_case(name, kind, dtype_name, params, seed):
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        res = {"centre": _run_centre, "offset": _run_offset, "layer": _run_layer}[kind](
            name, getattr(torch, dtype_name), params, seed)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


results = module_results(__file__)
CENTRE_CASES = [c for c in CASES if c[1] == "centre"]
OFFSET_CASES = [c for c in CASES if c[1] == "offset"]


@pytest.mark.parametrize("case", CENTRE_CASES, ids=[c[0] for c in CENTRE_CASES])
def test_fused_centring_equals_unfused(results, case):
    r = case_result(results, case[0])
    assert r["guards"] and r["wrote_into_out"], r
    for o in ("q", "k"):
        assert not r[f"{o}_nan"] and r[f"{o}_max_ulp"] == 0, f"{o} must equal rope-then-KeyTransform: {r}"
    if not case[3]["norm"]:
        assert r["torch_q_equal"] and r["torch_k_equal"], r
    assert r["wrong_stats_differ"], f"the check cannot see a transform of the wrong head/channel: {r}"


@pytest.mark.parametrize("case", OFFSET_CASES, ids=[c[0] for c in OFFSET_CASES])
def test_offset_norm_matches_torch(results, case):
    r = case_result(results, case[0])
    for o in ("q", "k"):  # the norm's bound, as tests/test_kernel_fused_ops.py
        assert not r[f"{o}_nan"] and r[f"{o}_err_eps"] <= 4, f"{o}: {r}"
        if case[2] != "float32":
            assert r[f"{o}_exact"] >= 0.99, f"{o}: {r}"


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layers_fuse_the_transform(results, case):
    r = case_result(results, case[0])
    assert r["calls"] == [["k_scale", "k_shift", "q_scale"]], r  # one launch, with the transform
    tol = 1e-6 if case[2] == "float32" else 2 ** -7  # the norm's last-bit freedom (1 ulp at the scale)
    for e in ("q_err", "k_err", "out_err"):
        assert r[e] <= tol, r


@pytest.mark.cuda
@pytest.mark.parametrize("case", CENTRE_CASES + OFFSET_CASES, ids=[c[0] for c in CENTRE_CASES + OFFSET_CASES])
def test_on_cuda(case):
    """The same checks compiled for the GPU (libdevice rsqrt, CUDA's mean: the offset norm's bound)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name, kind, dt, p, seed = case
    with torch.no_grad():
        r = (_run_centre if kind == "centre" else _run_offset)(name, getattr(torch, dt), p, seed, "cuda")
    (test_fused_centring_equals_unfused if kind == "centre" else test_offset_norm_matches_torch)({name: r}, case)


def test_centring_arguments_checked():
    import torch

    from ninfer.kernels.qk_norm_rope import qk_norm_rope

    q, k, cs = torch.zeros(2, 4, 64), torch.zeros(2, 2, 64), torch.zeros(2, 64)
    qs, kh = torch.ones(4, 64), torch.zeros(2, 64)
    for kw in (dict(q_scale=qs), dict(q_scale=qs, k_shift=kh),  # not all three
               dict(q_scale=torch.ones(2, 64), k_shift=kh, k_scale=kh),  # q_scale per kv head
               dict(q_scale=qs, k_shift=kh.half(), k_scale=kh),  # dtype
               dict(q_scale=qs, k_shift=kh, k_scale=torch.ones(2, 32))):  # width
        with pytest.raises(ValueError, match="qk_norm_rope"):
            qk_norm_rope(q, k, cs, cs, **kw)


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(child_main(CASES, _run_case))
