"""Tensor parallelism, the process side, on CPU over gloo: a TP=2 engine (this process = rank 0, one
spawned follower) must give the tokens of a TP=1 engine through chunked prefill, prefix reuse, an
abort mid-decode and preemption, with the follower's KV pool bit-identical to the driver's while
every rank holds every head; a follower that fails to load, hangs or is killed stops the driver
with one line (never a hang); the CLI and the server take -tp 2."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from ninfer.config import EngineConfig
from ninfer.distributed import parallel_state as ps
from ninfer.engine.engine import LLMEngine
from ninfer.engine.rank import pool_digest
from ninfer.engine.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60   # no spawn may take longer: a hang fails the test instead of stalling CI


def _ckpt(tiny_checkpoint, arch: str) -> Path:
    # 2 KV heads, so the same checkpoints serve when the model shards its heads over 2 ranks
    return tiny_checkpoint(arch=arch, hidden=64, heads=4, kv_heads=2, head_dim=64)


def _config(model: Path, kv: str, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), kv_dtype=kv, device="cpu", max_context=256, kv_capacity=4 * 64,
                        max_num_batched_tokens=64, **kw)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _run(engine: LLMEngine, prompts: dict[str, list[int]], n: int, abort: str | None = None) -> dict[str, list[int]]:
    """Every request to its end through engine.step(); `abort` is dropped once it has 3 tokens."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, _greedy(n))
    got: dict[str, list[int]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            got[out.request_id] = list(out.token_ids)
        if abort in got and len(got[abort]) >= 3 and abort in engine.scheduler.requests:
            engine.abort_request(abort)
    return got


def _workload(engine: LLMEngine) -> list:
    """Phases in one engine; returns what each produced. Checks the follower's pool after each."""
    g = __import__("random").Random(7)
    ids = lambda k: [g.randrange(10, 380) for _ in range(k)]  # noqa: E731
    shared = ids(130)
    phases = [({"long": ids(150), "short": ids(5)}, 4, None),                     # 150 > the 64-token chunk
              ({"p1": shared + ids(2)}, 2, None), ({"p2": shared + ids(3)}, 2, None),  # p2 reuses 2 pages
              ({"stay": ids(20), "drop": ids(10)}, 12, "drop"),                  # abort mid-decode
              ({f"q{i}": ids(60) for i in range(3)}, 8, None)]                   # 6 pages wanted of 4
    results = []
    for prompts, n, abort in phases:
        results.append(_run(engine, prompts, n, abort))
        bm = engine.block_manager
        assert bm.num_free_pages == bm.num_pages          # everything came back on the driver
        full = engine.pool.num_kv_heads == engine.model_config.num_kv_heads   # every rank holds every head
        if engine._group is not None and full and engine.device.type == "cpu":
            assert engine._group.digests() == [pool_digest(engine.pool)]   # same pages, same bytes
    assert len(results[3]["drop"]) < 12 and len(results[3]["stay"]) == 12
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 128 and stats.num_preemptions > 0, stats
    return results


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kv", ["bf16", "int8", "rk4v4-e8"])
def test_tp2_matches_tp1(tiny_checkpoint, arch: str, kv: str) -> None:
    model = _ckpt(tiny_checkpoint, arch)
    ref = _workload(LLMEngine(_config(model, kv), progress=False))
    engine = LLMEngine(_config(model, kv, tensor_parallel_size=2), progress=False)
    procs = list(engine._group.procs)
    try:
        assert ps.tp_size() == 2 and ps.is_driver()
        assert "tensor parallel: 2 ranks, backend=gloo, devices=cpu,cpu" in engine.startup_lines
        assert engine.plan.num_pages == 4
        assert _workload(engine) == ref
    finally:
        engine.shutdown()
    assert ps.tp_size() == 1 and not any(p.is_alive() for p in procs)
    from ninfer.distributed.group import TensorParallelError
    engine.add_request("late", [11, 12, 13], _greedy(1))
    with pytest.raises(TensorParallelError, match="^the tensor-parallel group was shut down$"):
        engine.step()   # never on one rank alone


def bad_checkpoint_worker(*args) -> None:
    """A follower whose copy of the checkpoint is truncated (the driver's is fine)."""
    import ninfer.engine.rank as rank_mod
    from ninfer.distributed.worker import worker_main
    real = rank_mod.build_rank

    def build(setup, device, **kw):
        bad = Path(tempfile.mkdtemp()) / "ckpt"
        shutil.copytree(setup.model_dir, bad)
        f = next(bad.glob("*.safetensors"))
        f.write_bytes(f.read_bytes()[:200])
        return real(dataclasses.replace(setup, model_dir=bad), device, **kw)

    rank_mod.build_rank = build
    worker_main(*args)


def silent_worker(*args) -> None:
    time.sleep(3600)


def _start_fails(model: Path, monkeypatch, entry, match: str) -> float:
    import ninfer.distributed.group as group
    monkeypatch.setattr(group, "WORKER_ENTRY", entry)
    t0 = time.monotonic()
    with pytest.raises(group.TensorParallelError, match=match) as e:
        LLMEngine(_config(model, "int8", tensor_parallel_size=2), progress=False)
    assert "\n" not in str(e.value) and ps.tp_size() == 1
    return time.monotonic() - t0


def test_follower_that_cannot_load_stops_the_start(tiny_checkpoint, monkeypatch) -> None:
    took = _start_fails(_ckpt(tiny_checkpoint, "qwen3"), monkeypatch, bad_checkpoint_worker,
                        r"^tensor-parallel rank 1 failed: could not load the model: \w+")
    assert took < TIMEOUT_S


def test_silent_follower_times_out(tiny_checkpoint, monkeypatch) -> None:
    import ninfer.distributed.group as group
    monkeypatch.setattr(ps, "DEFAULT_TIMEOUT_S", 3.0)
    monkeypatch.setattr(group, "EXIT_WAIT_S", 0.5)
    took = _start_fails(_ckpt(tiny_checkpoint, "qwen3"), monkeypatch, silent_worker,
                        r"^tensor-parallel rank 1 did not start within 3s \(NINFER_TP_TIMEOUT_S\)$")
    assert took < 15


def test_killed_follower_stops_the_driver(tiny_checkpoint) -> None:
    from ninfer.distributed.group import TensorParallelError
    engine = LLMEngine(_config(_ckpt(tiny_checkpoint, "llama"), "rk4v4-e8", tensor_parallel_size=2), progress=False)
    try:
        engine.add_request("a", list(range(10, 60)), _greedy(100))
        for _ in range(3):
            engine.step()
        proc = engine._group.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"^tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - t0 < 10
        with pytest.raises(TensorParallelError):   # it stays down
            engine.step()
    finally:
        engine.shutdown()
    assert ps.tp_size() == 1


def test_flag_refusals(tiny_checkpoint, capsys) -> None:
    import torch

    from ninfer.cli import main
    from ninfer.engine.tp import rank_devices
    with pytest.raises(SystemExit) as e:
        main(["generate", "-tp", "0", "--prompt", "x"])
    assert e.value.code == 2 and "must be >= 1: '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLMEngine(_config(_ckpt(tiny_checkpoint, "qwen3"), "int8", tensor_parallel_size=0), progress=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "device_count", lambda: 2)
        assert rank_devices(torch.device("cuda:1"), 1) == [torch.device("cuda:1")]
        with pytest.raises(ValueError, match=r"needs 4 GPU\(s\) \(cuda:0..cuda:3\) but 2 are visible"):
            rank_devices(torch.device("cuda"), 4)


def test_generate_cli_tp2(tiny_checkpoint, capsys) -> None:
    from ninfer.cli import main
    model = _ckpt(tiny_checkpoint, "qwen3")
    argv = ["generate", str(model), "--prompt", "hello world", "--greedy", "--max-tokens", "5", "--ignore-eos",
            "--device", "cpu", "--max-context", "256", "--kv-capacity", "512", "--kv-dtype", "int8"]
    assert main(argv) == 0
    ref = capsys.readouterr().out
    assert main(argv + ["-tp", "2"]) == 0
    out, err = capsys.readouterr()
    assert out == ref and "tensor parallel: 2 ranks, backend=gloo, devices=cpu,cpu" in err
    assert ps.tp_size() == 1


def _children(pid: int) -> list[int]:
    import psutil
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def test_server_tp2_answers_and_leaves_no_follower(tiny_checkpoint) -> None:
    import psutil
    model = _ckpt(tiny_checkpoint, "qwen3")
    from tests.serve_proc import serve_process
    with serve_process(str(model), "--device", "cpu", "-tp", "2", "--max-model-len", "256", "--kv-capacity", "512",
                       "--kv-dtype", "int8", "--disable-access-log", "--log-level", "warning", timeout_s=TIMEOUT_S,
                       env={"OMP_NUM_THREADS": "1"}) as srv:
        proc, url = srv.proc, srv.url
        followers = _children(proc.pid)
        assert followers, "no follower process"
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    log = srv.log
    assert rc == 0 and "tensor parallel: 2 ranks, backend=gloo" in log, log
    time.sleep(0.5)
    assert not [p for p in followers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"], log


@pytest.mark.cuda
def test_tp2_nccl_two_gpus(tiny_checkpoint) -> None:
    """Two GPUs over NCCL, decode CUDA graphs on every rank: the TP=1 tokens (fp32 weights, so the
    group's other summation order stays far below the gap between the top two logits of these
    models), then a killed follower stops the driver with one line."""
    import torch
    from ninfer.distributed.group import TensorParallelError
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    model = _ckpt(tiny_checkpoint, "qwen3")
    cfg = dataclasses.replace(_config(model, "rk4v4-e8"), device="cuda:0", max_num_seqs=4)
    ref = _workload(LLMEngine(cfg, progress=False))
    engine = LLMEngine(cfg.replace(tensor_parallel_size=2), progress=False)
    try:
        lines = "\n".join(engine.startup_lines)
        assert "tensor parallel: 2 ranks, backend=nccl, devices=cuda:0,cuda:1" in lines and "cuda_graphs=1" in lines
        assert _workload(engine) == ref
        engine.add_request("a", list(range(10, 60)), _greedy(100))
        engine.step()
        os.kill(engine._group.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"^tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - t0 < TIMEOUT_S
    finally:
        engine.shutdown()
    assert ps.tp_size() == 1
