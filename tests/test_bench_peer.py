"""`ninfer bench peer`: pruning of the llama.cpp tree, parsing of llama-bench / llama-perplexity output
(fixtures recorded from a CPU build of the pruned tree on SmolLM2-135M), llama-perplexity's chunking, and
one-line errors for bad flags. No llama.cpp build runs here."""
from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import pytest

from ninfer.bench import peer, peer_build as B, peer_run as R
from ninfer.bench.peer_build import PeerError

DATA = Path(__file__).parent / "data" / "peer"
ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp"

# a llama.cpp tree in miniature: what the build needs, and what pruning must drop
NEEDED = ["CMakeLists.txt", "cmake/common.cmake", "include/llama.h", "src/llama.cpp", "common/common.cpp",
          "vendor/CMakeLists.txt", "vendor/nlohmann/json.hpp", "vendor/cpp-httplib/CMakeLists.txt",
          "vendor/sheredom/subprocess.h", "vendor/hash/CMakeLists.txt",
          "ggml/CMakeLists.txt", "ggml/cmake/common.cmake", "ggml/include/ggml.h", "ggml/src/CMakeLists.txt",
          "ggml/src/ggml.c", "ggml/src/gguf.cpp", "ggml/src/ggml-cpu/ggml-cpu.c",
          "ggml/src/ggml-cuda/template-instances/fattn-vec-instance-q4_0-q4_0.cu", "ggml/src/ggml-cuda/mmq.cu",
          "tools/CMakeLists.txt", "tools/llama-bench/llama-bench.cpp", "tools/perplexity/perplexity.cpp",
          "convert_hf_to_gguf.py", "conversion/base.py", "gguf-py/gguf/__init__.py", "LICENSE"]
DROPPED = ["models/ggml-vocab-llama-bpe.gguf", "docs/build.md", "examples/simple/simple.cpp", "tests/test-rope.cpp",
           "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml-metal/ggml-metal.m", "ggml/src/ggml-sycl/x.cpp",
           "tools/server/server.cpp", "tools/ui/index.html", "tools/quantize/quantize.cpp",
           "vendor/miniaudio/miniaudio.h", "vendor/stb/stb_image.h", "gguf-py/tests/test_x.py", "app/main.cpp"]
TOOLS_CMAKE = "add_subdirectory(llama-bench)\nadd_subdirectory(perplexity)\n    add_subdirectory(server)\n" \
              "if (GGML_RPC)\n    add_subdirectory(rpc)\nendif()\nadd_subdirectory(quantize)\n"
VENDOR_CMAKE = "add_subdirectory(hash)\nadd_subdirectory(miniaudio)\nadd_subdirectory(nlohmann)\n" \
               "add_subdirectory(stb)\nif (LLAMA_BUILD_COMMON)\n    add_subdirectory(cpp-httplib)\nendif()\n"


def fake_sdist(tmp: Path) -> Path:
    path = tmp / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for rel in NEEDED + DROPPED + ["../../pyproject.toml"]:
            body = {"tools/CMakeLists.txt": TOOLS_CMAKE, "vendor/CMakeLists.txt": VENDOR_CMAKE}.get(rel, rel)
            data = body.encode()
            info = tarfile.TarInfo(str(Path(ROOT, rel)).replace("vendor/llama.cpp/../../", ""))
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def unguarded_subdirs(root: Path) -> list[str]:
    """add_subdirectory(x) lines of the tree's CMakeLists whose x is gone and that no EXISTS guard covers."""
    bad = []
    for cm in root.rglob("CMakeLists.txt"):
        lines = cm.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*add_subdirectory\(([\w./-]+)\)", line)
            if m and not (cm.parent / m.group(1)).is_dir():
                guarded = i > 0 and f"EXISTS ${{CMAKE_CURRENT_SOURCE_DIR}}/{m.group(1)}" in lines[i - 1]
                if not guarded and not m.group(1).startswith("${"):
                    bad.append(f"{cm.relative_to(root)}: {m.group(1)}")
    return bad


def test_prepare_keeps_the_build_and_drops_the_rest(tmp_path):
    out = tmp_path / "carry" / "llama.cpp"
    size = B.prepare(fake_sdist(tmp_path), out)
    for rel in NEEDED:
        assert (out / rel).is_file(), rel
    for rel in DROPPED:
        assert not (out / rel).exists(), rel
    assert size == B.tree_bytes(out) > 0
    tools = (out / "tools/CMakeLists.txt").read_text()
    assert "add_subdirectory(llama-bench)\nadd_subdirectory(perplexity)\n" in tools  # kept dirs untouched
    assert "if (EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/server) # pruned" in tools
    assert "    if (EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/rpc) # pruned\n        add_subdirectory(rpc)\n    endif()" in tools
    assert unguarded_subdirs(out) == []
    # guarding twice changes nothing, and a second prepare replaces the tree
    before = tools
    B.guard_subdirs(out / "tools/CMakeLists.txt")
    assert (out / "tools/CMakeLists.txt").read_text() == before
    (out / "stale").write_text("x")
    B.prepare(fake_sdist(tmp_path), out)
    assert not (out / "stale").exists()


def test_real_pruned_tree_when_present():
    root = Path(__file__).resolve().parents[1] / ".carry" / "llama.cpp"
    if not (root / "CMakeLists.txt").is_file():
        pytest.skip("no prepared llama.cpp tree at .carry/llama.cpp (`ninfer bench peer prepare --download`)")
    assert unguarded_subdirs(root) == []
    for rel in ("tools/llama-bench/llama-bench.cpp", "tools/perplexity/perplexity.cpp", "convert_hf_to_gguf.py",
                "ggml/src/ggml-cuda/template-instances/fattn-vec-instance-q8_0-q8_0.cu"):
        assert (root / rel).is_file(), rel
    assert B.tree_bytes(root) < 32 * 2**20  # it travels inside a 64 MiB working tree


@pytest.mark.parametrize("bad", ["not-a-tar", "no-llama"])
def test_prepare_rejects_other_archives(tmp_path, bad):
    path = tmp_path / "x.tar.gz"
    if bad == "not-a-tar":
        path.write_text("hello")
    else:
        with tarfile.open(path, "w:gz") as tf:
            info = tarfile.TarInfo("pkg/setup.py")
            tf.addfile(info, io.BytesIO(b""))
    with pytest.raises(PeerError):
        B.prepare(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_llama_bench_json_fixture():
    rows = R.parse_bench_json((DATA / "llama-bench.json").read_text())
    tests = {(r["test"], r["kv"], r["depth"]) for r in rows}
    assert {t for t, _, _ in tests} == {"prefill", "decode"}
    for r in rows:
        assert r["tok_s"] > 0 and r["stddev"] >= 0 and len(r["samples"]) >= 1
        mean = sum(r["samples"]) / len(r["samples"])
        assert r["tok_s"] == pytest.approx(mean, rel=1e-4)  # avg_ts is the mean of the per-repeat rates (printed to 6 places)
    with pytest.raises(PeerError):
        R.parse_bench_json("llama-bench: error: no model")


def test_llama_perplexity_kld_fixture():
    for kv in ("q8_0", "q4_0"):
        text = (DATA / f"llama-perplexity-kld-{kv}.txt").read_text()
        r = R.parse_kld(text)
        assert 0 <= r["median_kl"] <= r["p99_kl"] <= r["max_kl"]
        assert r["mean_kl"] > 0 and r["mean_kl_unc"] > 0 and 0 < r["same_top_pct"] <= 100
        assert r["n_ctx"] == 512 and r["chunks"] >= 2
        kvl = R.parse_kv_line(text)
        assert kvl["type_k"] == kvl["type_v"] == kv
    q8 = R.parse_kld((DATA / "llama-perplexity-kld-q8_0.txt").read_text())
    q4 = R.parse_kld((DATA / "llama-perplexity-kld-q4_0.txt").read_text())
    assert q4["mean_kl"] > q8["mean_kl"]  # 4-bit KV loses more than 8-bit
    with pytest.raises(PeerError):
        R.parse_kld("Final estimate: PPL = 12.3 +/- 0.4")


def test_kv_bytes_from_the_gguf_match_llama_cpp_log():
    """The speed table's llama.cpp KV bytes/token (from the GGUF's geometry) equal what llama.cpp logged."""
    from ninfer.checkpoints import alias_path
    try:
        gguf = alias_path("smollm2")
    except ValueError as e:
        pytest.skip(str(e))
    want = peer.kv_bytes_from_gguf(gguf, ["f16", "q8_0", "q4_0"])
    assert want["f16"] == 30 * 3 * (64 + 64) * 2  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    for kv in ("q8_0", "q4_0"):
        logged = R.parse_kv_line((DATA / f"llama-perplexity-kld-{kv}.txt").read_text())
        assert logged["bytes_per_token"] == pytest.approx(want[kv], rel=5e-3)  # the log rounds MiB to 2 places


def test_chunks_follow_llama_perplexity():
    ids = list(range(1, 1300))
    c = R.chunks(ids, 512, bos=None)
    assert len(c) == 1299 // 512 and c[1] == ids[512:1024]
    b = R.chunks(ids, 512, bos=0)
    assert [x[0] for x in b] == [0, 0] and b[0][1:] == ids[1:512]
    with pytest.raises(PeerError):
        R.chunks(ids[:100], 512, None)


@pytest.mark.parametrize("argv,msg", [
    (["speed", "--model", "x", "--gguf", "y", "--kv", "q5_1"], "--kv: unknown q5_1"),
    (["speed", "--model", "x", "--gguf", "y", "--depths", "0,abc"], "--depths"),
    (["speed", "--model", "x", "--gguf", "y", "--kv-dtype", "nope"], "--kv-dtype"),
    (["speed", "--model", "x", "--gguf", "y", "--repeats", "0"], "--repeats"),
    (["kl", "--model", "x", "--gguf", "y", "--kl-kv-dtype", "nope"], "--kl-kv-dtype"),
    (["kl", "--model", "x", "--gguf", "y", "--ctx", "2"], "--ctx"),
    (["kl", "--model", "x", "--gguf", "/nonexistent.gguf"], "no such GGUF"),
    (["all", "--out-dir", "OUT", "--stages", "build,bake"], "--stages: unknown bake"),
    (["all", "--out-dir", "OUT", "--models", "gpt5"], "--models: unknown gpt5"),
    (["prepare", "--sdist", "/nonexistent.tar.gz"], "no such sdist"),
    (["build", "--src", "/nonexistent"], "not a prepared llama.cpp tree"),
])
def test_bad_flags_give_one_line(tmp_path, capsys, argv, msg):
    from ninfer.cli import main
    argv = [str(tmp_path / "o") if a == "OUT" else a for a in argv]
    assert main(["bench", "peer", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ninfer bench peer {argv[0]}: ") and msg in err[0], err


def test_read_kld_tokens(tmp_path):
    import struct
    toks = list(range(7, 7 + 2 * 16))
    path = tmp_path / "base.kld"
    path.write_bytes(b"_logits_" + struct.pack("<3i", 16, 100, 2) + struct.pack("<32i", *toks) + b"\0" * 64)
    assert R.read_kld_tokens(path) == (16, 100, toks)
    path.write_bytes(b"_logits_" + struct.pack("<3i", 16, 100, 2) + struct.pack("<8i", *toks[:8]))
    with pytest.raises(PeerError, match="truncated"):
        R.read_kld_tokens(path)
    path.write_bytes(b"GGUF" + b"\0" * 40)
    with pytest.raises(PeerError, match="not a llama-perplexity"):
        R.read_kld_tokens(path)


def test_all_reports_missing_models_and_writes_its_table(tmp_path, capsys):
    from ninfer.cli import main
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "llama-bench").write_text("")
    out = tmp_path / "out"
    rc = main(["bench", "peer", "all", "--out-dir", str(out), "--stages", "speed,kl", "--models", "qwen3-8b",
               "--work", str(tmp_path / "work"), "--bin-dir", str(bins)])
    assert rc == 0
    table = (out / "peer.md").read_text()
    assert "qwen3-8b: skipped: no checkpoint / GGUF under" in table and table in capsys.readouterr().out
    assert (out / "models.json").is_file()


def test_default_text_leaves_out_the_calibration_passage(tmp_path):
    from ninfer.bench import kv_sim
    from ninfer.kvcache import centering
    text = peer.default_text(tmp_path / "t.txt").read_text(encoding="utf-8")
    docs = kv_sim.documents()
    assert centering.PASSAGE.read_text(encoding="utf-8") not in text
    assert all(body in text for name, body in docs.items() if name != centering.PASSAGE.stem)


def test_ninfer_kl_centred_names_use_the_engine_calibration(tiny_checkpoint):
    """`rk4v4-e8+c` scores with the keys centred by statistics of the calibration passage: it equals
    the KL computed by hand with kv_sim.key_stats, and differs from the uncentred codec."""
    import torch

    from ninfer.bench import kv_sim
    from ninfer.kvcache import centering
    path = tiny_checkpoint(arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=384)
    ids = torch.randint(0, 300, (96,), generator=torch.Generator().manual_seed(5)).tolist()
    res = R.ninfer_kl(str(path), ids, ["rk4v4-e8", "rk4v4-e8+c"], ctx=32, device="cpu", log=lambda *_: None)["results"]
    m, tok = kv_sim.load(str(path))
    cal = kv_sim.token_ids(tok, {"c": centering.PASSAGE.read_text(encoding="utf-8")}, centering.TOKENS)["c"]
    stats = kv_sim.key_stats(m, cal, centering.ALPHA)
    batch = torch.tensor(R.chunks(ids, 32, None))

    def lp(name, keys=None):
        with kv_sim.quantized_kv(m, kv_sim.format_codec(name), keys=keys), torch.no_grad():
            return torch.cat([torch.log_softmax(m(input_ids=r[None], use_cache=False).logits[0, 16:31].double(), -1)
                              for r in batch])
    ref = lp("bf16")  # the reference: bf16 KV
    want = float(kv_sim.kl(ref, lp("rk4v4-e8", stats)).mean())
    assert res["rk4v4-e8+c"]["mean_kl"] == pytest.approx(want, rel=1e-6)
    assert res["rk4v4-e8+c"]["mean_kl"] != pytest.approx(res["rk4v4-e8"]["mean_kl"], rel=1e-3)
