"""Tensor-parallel model forward on the CPU: two ranks over gloo (spawned processes, a free TCP
port) against the same model in one process, fp32, on transformers-written random checkpoints:
Qwen3 (GQA, an odd vocabulary, so the last rank's vocabulary rows are padding), Llama with tied
embeddings, and a Qwen3.5 hybrid (GDN + gated attention). One varlen prefill step of three
sequences, a step mixing a prefill continuation with decodes, then decode steps, through the
reference backend over real KV pages in several formats. Every rank's logits (full vocabulary)
must equal the single-process ones; a rank holding another rank's shard of one tensor must not.
Each rank holds only its shard: its parameter count is the planner's per-rank arithmetic."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.tiny_models import build_metadata, make_checkpoint, make_hybrid_checkpoint

WORLD = 2
PAGE = 16
JOIN_TIMEOUT_S = 120
FORMATS = ("auto", "bf16", "int8", "rk4v4-e8")
# the KV formats each model runs in: Qwen2 is there for its q|k|v biases (split with the rows)
MODEL_FORMATS = {"qwen3": FORMATS, "llama": FORMATS, "hybrid": FORMATS, "qwen2": ("auto", "int8")}
MODELS = list(MODEL_FORMATS)
# fp32 model and KV: only the order of the all_reduce sums differs
EXACT_RTOL = 1e-5
# quantized KV: a value on a rounding boundary may take the neighbouring code after a last-bit
# change (measured: at most 1.1e-4); a wrong shard is off by ~1 (test_another_ranks_shard_is_caught)
QUANT_RTOL = 2e-3
# one tensor of layer 0 exchanged between the ranks
SWAP = {"qwen3": "model.layers.0.self_attn.qkv_proj.weight", "llama": "model.layers.0.mlp.gate_up_proj.weight",
        "qwen2": "model.layers.1.self_attn.qkv_proj.bias",
        "hybrid": "model.layers.0.linear_attn.in_proj.weight"}
SEEDS = (7, 8)
LENS = (37, 20, 9)  # prompt lengths; step 1 prefills 25 / 20 / 9 tokens, step 2 the rest of the first


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def run_job(path: str, kv_dtype: str, swap: str | None, device: str = "cpu") -> dict[str, Any]:
    """The logits of every step of the schedule, this rank's parameter count and embedding rows."""
    from ninfer.attention.reference import ReferenceAttentionBackend
    from ninfer.distributed import parallel_state as ps
    from ninfer.kvcache.formats import get_format
    from ninfer.kvcache.pool import KVCachePool
    from ninfer.models import load_model

    model = load_model(path, dtype="fp32", device=device, progress=False)
    params = dict(model.named_parameters())
    if swap:  # this rank computes with the other rank's shard of one tensor
        p = params[swap]
        p.copy_(ps.all_gather(p[None].clone(), dim=0)[1 - ps.tp_rank()])
    spec = model.cache_specs(get_format(kv_dtype))
    out = []
    for seed in SEEDS:  # a fresh pool each: stale pages and states must not matter
        backend = ReferenceAttentionBackend(KVCachePool.from_spec(spec, 16, 4, device, model.dtype, page_size=PAGE))
        out += _schedule(model, backend, seed)
    return {"logits": torch.cat(out).cpu(), "params": sum(p.numel() for p in params.values()),
            "embed_rows": model.model.embed_tokens.weight.shape[0]}


def _schedule(model: Any, backend: Any, seed: int) -> list[torch.Tensor]:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    dev = model.device
    seqs = [torch.randint(0, vocab, (n + 4,), generator=gen).to(dev) for n in LENS]  # 4 more tokens: decodes
    first_pages, slots = [0, 4, 8], [2, 0, 3]
    done = [0, 0, 0]
    steps = [[25, 20, 9], [12, 1, 1], [1, 1, 1], [1, 1, 1]]
    out = []
    for q_lens in steps:
        meta = build_metadata(q_lens, [d + n for d, n in zip(done, q_lens)], PAGE, first_pages)
        meta.state_slots = torch.tensor(slots, dtype=torch.int32)
        meta.has_initial_state = torch.tensor([d > 0 for d in done])
        if dev.type != "cpu":
            for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "state_slots",
                      "has_initial_state"):
                setattr(meta, f, getattr(meta, f).to(dev))
        ids = torch.cat([s[d:d + n] for s, d, n in zip(seqs, done, q_lens)])
        positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, q_lens)]).to(dev)
        out.append(model.compute_logits(model(ids, positions, meta, backend)))
        done = [d + n for d, n in zip(done, q_lens)]
    return out


def _worker(rank: int, port: int, jobs: list[tuple[str, str, str, str | None]], out: str, kind: str) -> None:
    from ninfer.distributed import parallel_state as ps
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if kind == "cuda" else "cpu"  # NCCL between GPUs, gloo on the CPU
    ps.init_tp(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout_s=60, device=torch.device(device))
    try:
        torch.save({key: run_job(path, fmt, swap, device) for key, path, fmt, swap in jobs}, f"{out}/rank{rank}.pt")
    finally:
        ps.destroy_tp()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(jobs: list[tuple[str, str, str, str | None]], out: Path, kind: str = "cpu") -> list[dict[str, Any]]:
    """Every job on WORLD spawned ranks; each rank's results. A rank that hangs is killed."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, jobs, str(out), kind), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} did not finish within {JOIN_TIMEOUT_S} s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * WORLD, f"rank exit codes {codes}"
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tp")
    return {
        "qwen3": make_checkpoint(d, arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                                 vocab=389),
        "llama": make_checkpoint(d, arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                                 tie_word_embeddings=True),
        "hybrid": make_hybrid_checkpoint(d, layer_types=("linear", "full", "linear"), heads=4, kv_heads=2,
                                         head_dim=128, linear_k_heads=2, linear_v_heads=4),
        "qwen2": make_checkpoint(d, arch="qwen2", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64),
    }


@pytest.fixture(scope="module")
def results(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """(single-process results, every rank's results), by (model, format[, 'swap'])."""
    jobs = [(f"{m}/{f}", str(p), f, None) for m, p in checkpoints.items() for f in MODEL_FORMATS[m]]
    jobs += [(f"{m}/auto/swap", str(p), "auto", SWAP[m]) for m, p in checkpoints.items()]
    single = {key: run_job(path, fmt, None) for key, path, fmt, swap in jobs if swap is None}
    return single, run_ranks(jobs, tmp_path_factory.mktemp("tp-out"))


@pytest.mark.parametrize("model,fmt", [(m, f) for m, fs in MODEL_FORMATS.items() for f in fs])
def test_two_ranks_match_one_process(results, model: str, fmt: str) -> None:
    single, ranks = results
    ref = single[f"{model}/{fmt}"]["logits"]
    if model == "qwen3":  # 389 rows: rank 1 holds 194 and one padding row, whose logit is dropped
        assert ref.shape[1] == 389
    tol = EXACT_RTOL if fmt == "auto" else QUANT_RTOL
    for r, got in enumerate(ranks):
        logits = got[f"{model}/{fmt}"]["logits"]
        assert logits.shape == ref.shape and logits.dtype == torch.float32
        err = _rel(logits, ref)
        assert err < tol, f"rank {r}: {model} {fmt} logits differ by {err:.2e} (relative), tolerance {tol:.0e}"


@pytest.mark.parametrize("model", MODELS)
def test_another_ranks_shard_is_caught(results, model: str) -> None:
    """The tolerance above would fail a wrong shard: one tensor exchanged between ranks."""
    single, ranks = results
    ref = single[f"{model}/auto"]["logits"]
    for got in ranks:
        assert _rel(got[f"{model}/auto/swap"]["logits"], ref) > 50 * QUANT_RTOL


@pytest.mark.parametrize("model", MODELS)
def test_each_rank_holds_its_shard(results, checkpoints: dict[str, Path], model: str) -> None:
    from ninfer.layers.tp_geometry import shard_param_count, vocab_shard
    from ninfer.model_config import ModelConfig
    cfg = ModelConfig.load(checkpoints[model])
    single, ranks = results
    assert single[f"{model}/auto"]["params"] == cfg.num_params()
    for got in ranks:
        assert got[f"{model}/auto"]["params"] == shard_param_count(cfg, WORLD) < cfg.num_params()
        assert got[f"{model}/auto"]["embed_rows"] == vocab_shard(cfg.vocab_size, WORLD)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_over_nccl_match_one_gpu(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The same on GPUs: NCCL collectives, the CUDA layer kernels (fused norms, RoPE, fla's GDN).
    fp32 GEMMs may pick other reduction splits for the half-width shards, hence 1e-4."""
    jobs = [(f"{m}/{f}", str(p), f, None) for m, p in checkpoints.items() for f in ("auto", "rk4v4-e8")]
    single = {key: run_job(path, fmt, None, "cuda:0") for key, path, fmt, _ in jobs}
    for r, got in enumerate(run_ranks(jobs, tmp_path, "cuda")):
        for key, *_ in jobs:
            err = _rel(got[key]["logits"], single[key]["logits"])
            assert err < (1e-4 if key.endswith("auto") else QUANT_RTOL), f"rank {r}: {key} differs by {err:.2e}"


# ---- in one process: a rank's construction and loading need no collective, so the group's size
# and rank are set by hand


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_refusals_name_the_numbers(tiny_checkpoint, tmp_path: Path, as_rank) -> None:
    import json

    from ninfer.layers.tp_geometry import check_tensor_parallel
    from ninfer.model_config import ConfigError, ModelConfig
    from ninfer.models import CheckpointError, load_model
    qwen3_8b = ModelConfig.from_dict(dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                                          intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                                          num_key_value_heads=8, head_dim=128))
    with pytest.raises(ConfigError, match="^tensor-parallel-size 3 does not divide the 8 KV heads of Qwen3-8B$"):
        check_tensor_parallel(qwen3_8b, 3, "Qwen3-8B")
    with pytest.raises(ConfigError, match="tensor-parallel-size 16 exceeds the 8 KV heads of Qwen3-8B.*at most 8"):
        check_tensor_parallel(qwen3_8b, 16, "Qwen3-8B")
    check_tensor_parallel(qwen3_8b, 8, "Qwen3-8B")
    path = tiny_checkpoint(heads=4, kv_heads=2, head_dim=64)
    as_rank(0, 4)
    with pytest.raises(ConfigError, match=f"tensor-parallel-size 4 exceeds the 2 KV heads of {path.name}"):
        load_model(path, progress=False)
    quant = _copy(path, tmp_path / "fp8")
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quant / "config.json").write_text(json.dumps(cfg))
    as_rank(1, 2)
    with pytest.raises(CheckpointError, match="^fp8: fp8 weights cannot be split across ranks; "
                                              "tensor-parallel-size 2 needs a bf16/fp16/fp32 checkpoint$"):
        load_model(quant, progress=False)


@pytest.mark.parametrize("damage", ["truncate", "shape", "missing"])
def test_a_rank_names_a_damaged_tensor(tiny_checkpoint, tmp_path: Path, as_rank, damage: str) -> None:
    """A rank reads slices, not whole tensors: the loader's messages for damaged checkpoints stay."""
    import os

    from safetensors.torch import load_file, save_file

    from ninfer.models import CheckpointError, load_model
    path = _copy(tiny_checkpoint(heads=4, kv_heads=2, head_dim=64), tmp_path / "m")
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    if damage == "truncate":
        os.truncate(f, f.stat().st_size - 100)
        match = r"model\.safetensors.*truncated"
    elif damage == "shape":
        name = "model.layers.0.self_attn.o_proj.weight"
        tensors[name] = tensors[name][:, :-8].contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})
        match = rf"model\.safetensors: tensor {name} has shape \[64, 248\].*\[64, 256\]"
    else:
        tensors.pop("model.layers.1.self_attn.k_proj.weight")
        save_file(tensors, str(f), metadata={"format": "pt"})
        match = r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight"
    as_rank(1, 2)
    with pytest.raises(CheckpointError, match=match):
        load_model(path, progress=False)


def test_rank_reads_only_its_slices(checkpoints: dict[str, Path], as_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2: every split parameter is its rows / columns of the checkpoint tensors (written out
    here by head arithmetic), and no split tensor is ever read whole."""
    from safetensors.torch import load_file

    from ninfer.models import load_model, loader
    whole: list[str] = []
    real_open = loader._open

    class Spy:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> "Spy":
            self.f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.f.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            whole.append(name)
            return self.f.get_tensor(name)

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.f, attr)

    monkeypatch.setattr(loader, "_open", lambda path: Spy(real_open(path)))
    as_rank(1, 2)
    ck = load_file(str(checkpoints["qwen3"] / "model.safetensors"))
    m = dict(load_model(checkpoints["qwen3"], dtype="fp32", progress=False).named_parameters())
    a = "model.layers.1.self_attn."
    assert torch.equal(m[a + "qkv_proj.weight"], torch.cat([ck[a + "q_proj.weight"][128:], ck[a + "k_proj.weight"][64:],
                                                            ck[a + "v_proj.weight"][64:]]))
    assert torch.equal(m[a + "o_proj.weight"], ck[a + "o_proj.weight"][:, 128:])
    assert torch.equal(m[a + "q_norm.weight"], ck[a + "q_norm.weight"])
    f = "model.layers.0.mlp."
    assert torch.equal(m[f + "gate_up_proj.weight"], torch.cat([ck[f + "gate_proj.weight"][64:],
                                                                ck[f + "up_proj.weight"][64:]]))
    assert torch.equal(m[f + "down_proj.weight"], ck[f + "down_proj.weight"][:, 64:])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # 389 rows: 195 + 194 and one padding row
        assert m[name].shape[0] == 195 and torch.equal(m[name][:194], ck[name][195:])
    ck = load_file(str(checkpoints["hybrid"] / "model.safetensors"))
    m = dict(load_model(checkpoints["hybrid"], dtype="fp32", progress=False).named_parameters())
    g = "model.layers.0.linear_attn."
    # key heads 2 x 32 and value heads 4 x 32: rank 1 has key head 1 and value heads 2, 3
    qkv = ck[g + "in_proj_qkv.weight"]
    assert torch.equal(m[g + "in_proj.weight"], torch.cat([qkv[32:64], qkv[96:128], qkv[192:256],
                                                           ck[g + "in_proj_z.weight"][64:],
                                                           ck[g + "in_proj_b.weight"][2:], ck[g + "in_proj_a.weight"][2:]]))
    conv = ck[g + "conv1d.weight"]
    assert torch.equal(m[g + "conv1d.weight"], torch.cat([conv[32:64], conv[96:128], conv[192:256]]))
    assert torch.equal(m[g + "dt_bias"], ck[g + "dt_bias"][2:]) and torch.equal(m[g + "A_log"], ck[g + "A_log"][2:])
    assert torch.equal(m[g + "out_proj.weight"], ck[g + "out_proj.weight"][:, 64:])
    assert torch.equal(m[g + "norm.weight"], ck[g + "norm.weight"])
    split = ("proj.weight", "embed_tokens.weight", "lm_head.weight", "conv1d.weight", "dt_bias", "A_log")
    assert whole and not [n for n in whole if n.endswith(split)], whole
