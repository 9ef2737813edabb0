"""Fused elementwise kernels (ninfer/kernels/rmsnorm.py, qk_norm_rope.py, silu_mul.py) vs the model's
torch code, on CPU.

Interpreter: every kernel check runs in one child process with ``TRITON_INTERPRET=1``
(tests/triton_interp.py says why and how).

What a case checks, per output element, in ulps of the output dtype against the torch reference
(the model's current code: ninfer/layers norm.py RMSNorm, mlp.py GatedMLP, rotary.py apply_rotary):
* exact where the kernel has no freedom: the residual sum, RoPE without the q/k norm (every op
  rounded where torch rounds);
* elsewhere >= 99% bit-equal (bf16/fp16), <= 2 ulps (one at the rounding after the norm, doubled
  by the weight multiply), within 4 eps at the tensor's scale: float32 intermediates may differ
  in their last bit (the norm's mean: summation order; rsqrt and silu's exp: numpy vs torch's
  CPU code); fp32 outputs show those as a few ulps.
Output buffers are passed in as contiguous slices of a NaN-filled buffer: every element must be
written and the guard rows around the slice left alone. Inputs are strided views where the model
passes views (q/k split from a fused qkv output, gate|up as a column slice). Sizes: hidden not a
power of 2 (96, 320), T = 1/3/17, head_dim 64/128/256, partial rotary, large positions.
The whole tiny model (Qwen3 with q/k norms; Llama with partial rotary) run through the kernels
matches its torch path's logits, and launches the expected kernels (4 per layer).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.triton_interp import child_main, case_result, module_results  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")
# (name, kind, dtype, params, seed)
CASES = []
for _dt in DTYPES:
    for _t, _n, _s in ((1, 96, 0), (17, 320, 1), (3, 128, 2)):
        CASES.append((f"rms-{_dt}-t{_t}-n{_n}", "rms", _dt, dict(t=_t, n=_n), _s))
        CASES.append((f"addrms-{_dt}-t{_t}-n{_n}", "addrms", _dt, dict(t=_t, n=_n), _s + 10))
    CASES.append((f"rms-heads-{_dt}", "rms", _dt, dict(t=3, n=64, heads=5), 3))  # per-head strided view
    CASES.append((f"addrms-inplace-{_dt}", "addrms", _dt, dict(t=5, n=96, inplace=True), 4))
    for _t, _i, _s in ((1, 96, 5), (17, 320, 6), (3, 1000, 7)):
        CASES.append((f"silu-{_dt}-t{_t}-i{_i}", "silu", _dt, dict(t=_t, i=_i), _s))
    # (T, Hq, Hkv, D, partial_rotary_factor, q/k norm, seed)
    for _t, _hq, _hkv, _d, _f, _norm, _s in ((1, 4, 2, 128, 1.0, True, 20), (3, 6, 1, 64, 1.0, True, 21),
                                             (17, 2, 1, 256, 1.0, False, 22), (3, 4, 2, 128, 0.5, True, 23),
                                             (3, 2, 2, 64, 1.0, False, 24), (5, 2, 1, 256, 0.75, False, 25)):
        CASES.append((f"qk-{_dt}-t{_t}-q{_hq}-kv{_hkv}-d{_d}-r{_f}-{'norm' if _norm else 'nonorm'}", "qk", _dt,
                      dict(t=_t, hq=_hq, hkv=_hkv, d=_d, frac=_f, norm=_norm), _s))
CASES.append(("qk-bfloat16-yarn-norm", "qk", "bfloat16",
              dict(t=4, hq=4, hkv=2, d=128, frac=1.0, norm=True, yarn=True), 26))
CASES.append(("rms-bf16-x-fp32-weight", "rms", "bfloat16", dict(t=3, n=96, wdtype="float32"), 27))
MODEL_CASES = [("model-qwen3-float32", "model", "float32", dict(arch="qwen3"), 30),
               ("model-qwen3-bfloat16", "model", "bfloat16", dict(arch="qwen3"), 31),
               ("model-llama-partial-float32", "model", "float32", dict(arch="llama"), 32)]
CASES += MODEL_CASES


def _ulps(a, b):
    """Per-element distance in ulps of a's dtype (sign-magnitude bits mapped to a monotone integer)."""
    import torch

    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    nb = 16 if bits == torch.int16 else 32

    def key(x):
        i = x.contiguous().view(bits).to(torch.int64)
        mag = i & ((1 << (nb - 1)) - 1)
        return torch.where(i < 0, -mag, mag)
    return (key(a) - key(b)).abs()


def _compare(out, ref, name):
    import torch

    if out.shape != ref.shape or out.dtype != ref.dtype:
        return {f"{name}_shape": f"{out.dtype}{list(out.shape)} vs {ref.dtype}{list(ref.shape)}"}
    u = _ulps(out, ref)
    nan = bool(torch.isnan(out).any()) or bool(torch.isnan(ref).any())
    # the largest error in eps of the dtype at the tensor's scale (a near-cancelling RoPE sum can be
    # many ulps of its own small value off after a 1-ulp difference in its inputs)
    err = float((out.float() - ref.float()).abs().max() / (ref.float().abs().max() * torch.finfo(ref.dtype).eps))
    return {f"{name}_max_ulp": int(u.max()) if u.numel() else 0, f"{name}_exact": float((u == 0).float().mean()),
            f"{name}_err_eps": err, f"{name}_nan": nan}


def _poisoned(shape, dtype):
    """A contiguous buffer of `shape` inside a NaN-filled one with guard rows before and after."""
    import torch

    big = torch.full((shape[0] + 2, *shape[1:]), float("nan"), dtype=dtype)
    return big, big[1:-1]


def _guards_ok(big):
    import torch

    return bool(torch.isnan(big[0]).all()) and bool(torch.isnan(big[-1]).all())


def _run_rms(name, kind, dt, p, seed):
    import torch

    from ninfer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
    from ninfer.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(seed)
    t, n = p["t"], p["n"]
    eps = 1e-6
    mod = RMSNorm(n, eps)
    with torch.no_grad():
        mod.weight.copy_(1 + 0.3 * torch.randn(n, generator=gen))
    mod = mod.to(getattr(torch, p["wdtype"]) if "wdtype" in p else dt)
    res = {"name": name}
    if "heads" in p:  # [T, H, N] view with a row stride wider than H*N and a head stride of 2N
        base = (torch.randn(t, p["heads"] * 2 * n + 7, generator=gen) * 2).to(dt)
        x = base[:, 7:].reshape(t, p["heads"], 2 * n)[:, :, n:]
    else:
        x = (torch.randn(t, n, generator=gen) * 3).to(dt)
    with torch.no_grad():
        if kind == "rms":
            out_dt = torch.promote_types(x.dtype, mod.weight.dtype)
            big, out = _poisoned(x.shape, out_dt)
            got = rmsnorm(x, mod.weight, eps, out=out)
            res.update(_compare(got, mod(x), "out"), guards=_guards_ok(big), wrote_into_out=got is out)
        else:
            r = (torch.randn(t, n, generator=gen) * 3).to(dt)
            ref_res = r + x
            ref_out = mod(ref_res)
            big, out = _poisoned(x.shape, x.dtype)
            if p.get("inplace"):
                r_in = r.clone()
                got, got_res = fused_add_rmsnorm(x, r_in, mod.weight, eps, out=out, residual_out=r_in)
                guards = _guards_ok(big) and got_res is r_in
            else:
                big_r, res_out = _poisoned(x.shape, x.dtype)
                r0 = r.clone()
                got, got_res = fused_add_rmsnorm(x, r, mod.weight, eps, out=out, residual_out=res_out)
                guards = _guards_ok(big) and _guards_ok(big_r) and torch.equal(r, r0)  # input kept
            res.update(_compare(got, ref_out, "out"), **_compare(got_res, ref_res, "residual"), guards=guards,
                       wrote_into_out=got is out)
    return res


def _run_qk(name, kind, dt, p, seed):
    import torch

    from ninfer.kernels.qk_norm_rope import qk_norm_rope
    from ninfer.layers.norm import RMSNorm
    from ninfer.layers.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(seed)
    t, hq, hkv, d = p["t"], p["hq"], p["hkv"], p["d"]
    params = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": p["frac"]}
    if p.get("yarn"):
        params = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4096}
    rope = RotaryEmbedding(d, params, 16384)
    positions = torch.randint(0, 120_000, (t,), generator=gen)
    positions[0] = 0
    cos, sin = rope.cos_sin(positions)
    # q/k: views of a fused qkv output [T, (Hq + 2 Hkv) D], as Attention.forward splits it
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2).to(dt)
    q = qkv[:, :hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    qn = kn = None
    if p["norm"]:
        qn, kn = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
        with torch.no_grad():
            qn.weight.copy_(1 + 0.3 * torch.randn(d, generator=gen))
            kn.weight.copy_(1 + 0.3 * torch.randn(d, generator=gen))
        qn, kn = qn.to(dt), kn.to(dt)
    with torch.no_grad():
        rq, rk = (qn(q), kn(k)) if qn is not None else (q, k)
        rq, rk = apply_rotary(rq, cos, sin), apply_rotary(rk, cos, sin)
        bq, q_out = _poisoned(q.shape, q.dtype)
        bk, k_out = _poisoned(k.shape, k.dtype)
        gq, gk = qk_norm_rope(q, k, cos, sin, qn.weight if qn is not None else None,
                              kn.weight if kn is not None else None, 1e-6, q_out=q_out, k_out=k_out)
    return {"name": name, **_compare(gq, rq, "q"), **_compare(gk, rk, "k"),
            "guards": _guards_ok(bq) and _guards_ok(bk), "wrote_into_out": gq is q_out and gk is k_out}


def _run_silu(name, kind, dt, p, seed):
    import torch

    from ninfer.kernels.silu_mul import silu_mul
    from ninfer.layers.mlp import GatedMLP

    gen = torch.Generator().manual_seed(seed)
    t, i = p["t"], p["i"]
    wide = (torch.randn(t, 2 * i + 5, generator=gen) * 4).to(dt)
    gate_up = wide[:, 3:3 + 2 * i]  # row stride 2I + 5, offset 3: a strided view
    mlp = GatedMLP(8, i, False, "silu").to(dt)
    mlp.down_proj = torch.nn.Identity()  # the model's own forward, minus the matmuls
    mlp.gate_up_proj = torch.nn.Identity()
    with torch.no_grad():
        ref = mlp(gate_up)
        big, out = _poisoned((t, i), gate_up.dtype)
        got = silu_mul(gate_up, out=out)
    return {"name": name, **_compare(got, ref, "out"), "guards": _guards_ok(big), "wrote_into_out": got is out}


def _tiny_model(arch, dt, seed):
    import torch

    from ninfer.model_config import ModelConfig
    from ninfer.models.registry import get_model_class

    raw = dict(architectures=["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"], model_type=arch,
               vocab_size=64, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
               num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
               rope_theta=10000.0, torch_dtype="float32")
    if arch == "llama":
        raw["partial_rotary_factor"] = 0.5
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(seed)
    model = get_model_class(cfg.architecture)(cfg)
    with torch.no_grad():
        for pname, prm in model.named_parameters():
            if prm.dim() == 1:  # norm weights: away from 1 so a misplaced norm shows
                prm.copy_(1 + 0.3 * torch.randn(prm.shape))
            elif "embed" not in pname:
                prm.normal_(0, 0.1)
    return model.to(dt).eval()


def _run_model(name, kind, dt, p, seed):
    import torch

    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.layers import activation, attention, fused, norm
    from ninfer.kvcache.pool import KVCachePool
    from tests.tiny_models import build_metadata

    model = _tiny_model(p["arch"], dt, seed)
    cfg = model.config
    page = 16
    calls = {}
    owner = {"rmsnorm": norm, "fused_add_rmsnorm": norm, "qk_norm_rope": attention, "silu_mul": activation}
    orig = {f: getattr(m, f) for f, m in owner.items()}

    def counting(fname):
        def f(*a, **kw):
            calls[fname] = calls.get(fname, 0) + 1
            return orig[fname](*a, **kw)
        return f

    def run(use_fused):
        pool = KVCachePool("auto", cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, 8, page_size=page,
                           model_dtype=model.dtype)
        backend = ReferenceAttentionBackend(pool)
        gen = torch.Generator().manual_seed(seed)
        saved = fused.use_fused_kernels
        fused.use_fused_kernels = (lambda x: True) if use_fused else saved
        for f in orig:
            setattr(owner[f], f, counting(f) if use_fused else orig[f])
        try:
            logits = []
            with torch.no_grad():
                # prefill of two sequences (3 and 6 tokens), then one decode step of both
                for q_lens, starts in (([3, 6], [0, 0]), ([1, 1], [3, 6])):
                    ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), generator=gen)
                    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
                    meta = build_metadata(q_lens, [s + n for s, n in zip(starts, q_lens)], page, [0, 2])
                    calls.clear()
                    logits.append(model.compute_logits(model(ids, pos, meta, backend)))
            return torch.cat(logits)
        finally:
            fused.use_fused_kernels = saved
            for f in orig:
                setattr(owner[f], f, orig[f])

    ref = run(False)
    got = run(True)
    scale = float(ref.abs().max())
    return {"name": name, "max_abs_diff": float((got - ref).abs().max()), "logit_scale": scale,
            "argmax_equal": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "calls_per_step": dict(calls), "layers": cfg.num_layers, "finite": bool(torch.isfinite(got).all())}


def _run_case(name, kind, dtype_name, params, seed):
    import torch

    dt = getattr(torch, dtype_name)
    fn = {"rms": _run_rms, "addrms": _run_rms, "qk": _run_qk, "silu": _run_silu, "model": _run_model}[kind]
    t0 = time.perf_counter()
    res = fn(name, kind, dt, params, seed)
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def _child() -> int:
    return child_main(CASES, _run_case)


results = module_results(__file__)




KERNEL_CASES = [c for c in CASES if c[1] != "model"]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_fused_kernel_matches_torch(results, case):
    r = case_result(results, case[0])
    _, kind, dt, p, _ = case
    assert not [k for k in r if k.endswith("_shape")], f"wrong output shape/dtype: {r}"
    assert r["guards"] and r["wrote_into_out"], f"wrote outside the given buffers or ignored them: {r}"
    outs = [k[:-8] for k in r if k.endswith("_max_ulp")]
    assert outs, r
    for o in outs:
        assert not r[f"{o}_nan"], f"{o}: NaN left in the output (an element not written?): {r}"
        if o == "residual" or (kind == "qk" and not p["norm"]):  # no freedom: every op rounds as torch's
            assert r[f"{o}_max_ulp"] == 0, f"{o} must be bit-exact: {r}"
            continue
        # the norm's float32 mean/rsqrt or silu's exp may differ in the last bit: one ulp at the
        # rounding to the dtype, up to two after the weight multiply; fp32 shows the float32 ulps
        assert r[f"{o}_err_eps"] <= 4, f"{o}: {r}"
        if dt != "float32":
            assert r[f"{o}_exact"] >= 0.99, f"{o}: {r}"
        if kind != "qk":
            assert r[f"{o}_max_ulp"] <= (8 if dt == "float32" else 2), f"{o}: {r}"


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_forward_with_fused_kernels(results, case):
    r = case_result(results, case[0])
    n = r["layers"]
    # the last (decode) step's launches: 1 rmsnorm (first layer), 2 fused add+norm per layer
    # (the first layer's second, then each next layer's first and the final norm), 1+1 per layer
    assert r["calls_per_step"] == {"rmsnorm": 1, "fused_add_rmsnorm": 2 * n, "qk_norm_rope": n,
                                   "silu_mul": n}, r
    assert r["finite"]
    tol = 1e-5 if case[2] == "float32" else 2 ** -7  # bf16: measured bit-equal; allow 1 ulp at the scale
    assert r["max_abs_diff"] <= tol * r["logit_scale"], r
    assert r["argmax_equal"] == 1.0, r


def test_fused_ops_reject_bad_inputs():
    import torch

    from ninfer.kernels.qk_norm_rope import qk_norm_rope
    from ninfer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
    from ninfer.kernels.silu_mul import silu_mul

    x = torch.zeros(3, 96, dtype=torch.bfloat16)
    w = torch.ones(96, dtype=torch.bfloat16)
    bad = [
        lambda: rmsnorm(x, torch.ones(95, dtype=torch.bfloat16), 1e-6),  # weight size
        lambda: rmsnorm(x.to(torch.int32), w, 1e-6),  # dtype
        lambda: rmsnorm(x[None, None], w, 1e-6),  # 4-D
        lambda: rmsnorm(x, w, 1e-6, out=torch.empty(3, 96)),  # out dtype
        lambda: rmsnorm(x, w, 1e-6, out=torch.empty(96, 3, dtype=torch.bfloat16).t()),  # out not contiguous
        lambda: fused_add_rmsnorm(x, x[:2], w, 1e-6),  # residual shape
        lambda: fused_add_rmsnorm(x, x.float(), w, 1e-6),  # residual dtype
        lambda: silu_mul(torch.zeros(3, 7)),  # odd width
        lambda: silu_mul(torch.zeros(3, 8), out=torch.empty(3, 8)),  # out shape
    ]
    q = torch.zeros(2, 4, 64)
    k = torch.zeros(2, 2, 64)
    cs = torch.zeros(2, 64)
    bad += [
        lambda: qk_norm_rope(q, k[:, :, :32], cs, cs),  # head dims differ
        lambda: qk_norm_rope(q, k.half(), cs, cs),  # dtypes differ
        lambda: qk_norm_rope(q, k, cs[:, :63], cs[:, :63]),  # odd rotary dim
        lambda: qk_norm_rope(q, k, torch.zeros(2, 128), torch.zeros(2, 128)),  # rotary dim > head_dim
        lambda: qk_norm_rope(q, k, cs.half(), cs.half()),  # cos/sin not float32
        lambda: qk_norm_rope(q, k, cs[:1], cs[:1]),  # cos/sin rows
        lambda: qk_norm_rope(q, k, cs, cs, torch.ones(64), None),  # one weight only
        lambda: qk_norm_rope(q, k, cs, cs, torch.ones(32), torch.ones(32)),  # weight size
    ]
    for i, f in enumerate(bad):
        with pytest.raises(ValueError):
            f()
            pytest.fail(f"bad input {i} was accepted")


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child())
