"""KV quantization simulated inside transformers (ninfer/bench/kv_sim.py) and `bench kl --text`.

The hook must quantize exactly the K (after RoPE and k-norm) and V that transformers' own cache
holds, in the selected layers and planes only; KL is 0 without quantization and orders the
formats as their precision does (int8 far below rk4v4-e8) on a tiny random Qwen3."""
from __future__ import annotations

import json

import pytest
import torch

from ninfer.bench import kv_sim


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    path = tiny_checkpoint(arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=384)
    m, tok = kv_sim.load(str(path))
    return path, m, tok


def test_hook_sees_the_cached_k_and_v(model):
    _, m, _ = model
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


def test_kl_zero_unquantized_and_ordered(model):
    _, m, tok = model
    ids = kv_sim.token_ids(tok, {"a": kv_sim.documents()["river"], "b": kv_sim.documents()["bread"]}, 96)
    refs = {k: kv_sim.log_probs(m, x) for k, x in ids.items()}
    assert all(v == 0.0 for v in kv_sim.doc_kl(m, ids, refs, kv_sim.format_codec("auto")).values())
    kls = {n: sum(kv_sim.doc_kl(m, ids, refs, kv_sim.format_codec(n)).values())
           for n in ("int8", "rk4v4-e8:baseline", "rk4v4-e8")}
    assert 0 < kls["int8"] < 0.05 * kls["rk4v4-e8"]
    assert kls["rk4v4-e8"] > 0 and kls["rk4v4-e8:baseline"] > 0
    k_only = sum(kv_sim.doc_kl(m, ids, refs, kv_sim.format_codec("rk4v4-e8"), planes="k").values())
    assert 0 < k_only < kls["rk4v4-e8"] * 1.5


def test_baseline_codec_is_the_first_encoder():
    """rk4v4-e8:baseline reconstructs with the absmax/8 scale and the nearest points; the shipped
    encoder differs (refit) and has the lower error on Gaussian data."""
    from ninfer.kvcache import e8
    from ninfer.kvcache.formats import code_units, group_scales
    from ninfer.kvcache.hadamard import rotate

    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(3))
    xr = rotate(x)
    _, s = group_scales(xr, 8.0, round_up=True)
    p = e8.decode_e8(e8.encode_e8(code_units(xr, s, e8.GRID)))
    want = rotate((p.reshape(512, 2, 64) * s).reshape(512, 128))
    assert torch.equal(kv_sim.e8_baseline(x), want)
    new = kv_sim.format_codec("rk4v4-e8")(x)
    assert float(((new - x) ** 2).sum()) < float(((want - x) ** 2).sum())


def test_bench_kl_text_cli(model, capsys, tmp_path):
    from ninfer.cli import main

    path, _, _ = model
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
