"""KV quantization simulated inside transformers (ninfer/bench/kv_sim.py) and `bench kl --text`.

The hook must quantize exactly the K (after RoPE and k-norm) and V that transformers' own cache
holds, in the selected layers and planes only; KL is 0 without quantization and orders the
formats as their precision does (int8 far below rk4v4-e8) on a tiny random Qwen3."""
from __future__ import annotations

import json

import pytest
import torch

from ninfer.bench import kv_sim


def test_hook_sees_the_cached_k_and_v(kv_sim_model):
    _, m, _ = kv_sim_model
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = m(input_ids=ids, use_cache=True).past_key_values
    seen = []

    def record(x):
        seen.append(x.clone())
        return x

    with kv_sim.quantized_kv(m, record, layers=[1], planes="kv"):
        kv_sim.log_probs(m, ids)
    assert len(seen) == 2  # layer 1 only: K then V
    assert torch.equal(seen[0], cache.layers[1].keys[0].reshape(-1, 64))
    assert torch.equal(seen[1], cache.layers[1].values[0].reshape(-1, 64))
    assert m.config._attn_implementation != kv_sim._ATTN  # restored


def test_kl_zero_unquantized_and_ordered(kv_sim_model):
    _, m, tok = kv_sim_model
    ids = kv_sim.token_ids(tok, {"a": kv_sim.documents()["river"], "b": kv_sim.documents()["bread"]}, 96)
    refs = {k: kv_sim.log_probs(m, x) for k, x in ids.items()}
    assert all(v == 0.0 for v in kv_sim.doc_kl(m, ids, refs, kv_sim.format_codec("auto")).values())
    kls = {n: sum(kv_sim.doc_kl(m, ids, refs, kv_sim.format_codec(n)).values())
           for n in ("int8", "rk4v4-e8:refit", "rk4v4-e8")}
    assert 0 < kls["int8"] < 0.05 * kls["rk4v4-e8"]
    assert kls["rk4v4-e8"] > 0 and kls["rk4v4-e8:refit"] > 0
    k_only = sum(kv_sim.doc_kl(m, ids, refs, kv_sim.format_codec("rk4v4-e8"), planes="k").values())
    assert 0 < k_only < kls["rk4v4-e8"] * 1.5


def test_refit_candidate_codec():
    """rk4v4-e8:refit reconstructs from encode_e8_refit's bytes and scales; the shipped encoder is the
    nearest point at absmax/8, and the refit has the lower error on Gaussian data."""
    from ninfer.kvcache import e8
    from ninfer.kvcache.formats import code_units, group_scales
    from ninfer.kvcache.hadamard import rotate

    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(3))
    xr = rotate(x)
    _, s = group_scales(xr, 8.0, round_up=True)
    p = e8.decode_e8(e8.encode_e8(code_units(xr, s, e8.GRID)))
    shipped = rotate((p.reshape(512, 2, 64) * s).reshape(512, 128))
    assert torch.allclose(kv_sim.format_codec("rk4v4-e8")(x), shipped, atol=1e-6)
    data, s16 = e8.encode_e8_refit(code_units(xr, s, e8.GRID), s[..., 0])
    q = e8.decode_e8(data)
    want = rotate((q.reshape(512, 2, 64) * s16.float()[..., None]).reshape(512, 128))
    assert torch.equal(kv_sim.e8_refit(x), want)
    assert float(((want - x) ** 2).sum()) < float(((shipped - x) ** 2).sum())


def test_bench_kl_text_cli(kv_sim_model, capsys, tmp_path):
    from ninfer.cli import main

    path, _, _ = kv_sim_model
    out = tmp_path / "kl.json"
    assert main(["bench", "kl", str(path), "--text", "--kv-dtype", "int8,rk4v4-e8", "--planes", "kv,k",
                 "--tokens", "48", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| int8 | KV |" in text and "| rk4v4-e8 | K |" in text
    res = json.loads(out.read_text())
    assert [(r["kv_dtype"], r["planes"]) for r in res["rows"]] == [("int8", "kv"), ("int8", "k"),
                                                                     ("rk4v4-e8", "kv"), ("rk4v4-e8", "k")]
    assert len(res["rows"][0]["docs"]) == len(kv_sim.documents()) >= 5
    for bad in (["--kv-dtype", "int9"], ["--planes", "q"]):
        with pytest.raises(SystemExit, match="ninfer bench kl: "):
            main(["bench", "kl", str(path), "--text", *bad])
