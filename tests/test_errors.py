"""User mistakes get one line naming what is wrong and how to fix it (no traceback), and the CPU
defaults fit a CPU: fp32 compute without native bf16, a KV pool sized to the run, a thread count."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ninfer import cli


def _one_line_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_device_errors(tiny_model_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["generate", str(tiny_model_dir), "-p", "hi", "-q", "--device"]
    assert "unknown device 'foo': use auto, cpu, cuda or cuda:N" in _one_line_error(capsys, base + ["foo"])
    assert "unsupported device 'meta'" in _one_line_error(capsys, base + ["meta"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    err = _one_line_error(capsys, base + ["cuda"])
    assert "--device cuda: this torch build has no CUDA support" in err and "--device cpu" in err


def test_bad_config_field_names_field_and_file(tiny_model_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = "abc"
    (bad / "config.json").write_text(json.dumps(cfg))
    for argv in (["plan", str(bad)], ["generate", str(bad), "-p", "hi", "-q"]):
        err = capsys.readouterr() and _one_line_error(capsys, argv)
        assert f"{bad / 'config.json'}: field 'hidden_size' must be an integer, got 'abc'" in err, err


def test_hub_id_says_download_first(capsys: pytest.CaptureFixture) -> None:
    for argv in (["plan", "Qwen/Qwen3-8B"], ["generate", "Qwen/Qwen3-8B", "-p", "hi", "-q"]):
        err = _one_line_error(capsys, argv)
        assert "'Qwen/Qwen3-8B' is not a local directory" in err and "--local-dir" in err, err


def test_missing_path_and_unknown_alias(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = _one_line_error(capsys, ["generate", str(tmp_path / "nope"), "-p", "hi", "-q"])
    assert "no such model directory or file" in err and "smollm2" in err
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, ["generate", str(tmp_path / "empty"), "-p", "hi", "-q"])
    assert "no config.json (and no .gguf file)" in err


def test_checkpoint_without_tokenizer_takes_token_ids(tiny_model_dir: Path, tmp_path: Path) -> None:
    """As vLLM's skip_tokenizer_init: token-id prompts work and give token ids; a text prompt says why not."""
    from ninfer import LLM, SamplingParams
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, bare / f.name)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kw = dict(kv_dtype="bf16", device="cpu", max_context=128, kv_capacity=512)
    out = LLM(str(bare), **kw).generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    ref = LLM(str(tiny_model_dir), **kw).generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    assert list(out.token_ids) == list(ref.token_ids) and len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer, and .* has no tokenizer files; pass token ids"):
        LLM(str(bare), **kw).generate("hello", params)


@pytest.mark.parametrize("native", [False, True])
def test_cpu_dtype_follows_native_bf16(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    from ninfer.engine import cpu
    from ninfer.engine.engine import LLMEngine
    from ninfer.config import EngineConfig
    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    path = tiny_checkpoint(dtype="bfloat16")
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_dtype="bf16", max_context=128), progress=False)
    assert eng.dtype == (torch.bfloat16 if native else torch.float32)
    assert ("dtype=bf16" if native else "dtype=fp32 (the CPU has no native bf16") in eng.startup_lines[-1]
    forced = LLMEngine(EngineConfig(model=str(path), device="cpu", kv_dtype="bf16", max_context=128, dtype="bf16"),
                       progress=False)
    assert forced.dtype == torch.bfloat16  # an explicit --dtype is kept


def test_cpu_auto_kv_pool_is_sized_to_the_run(tiny_model_dir: Path) -> None:
    from ninfer.config import PAGE_SIZE, EngineConfig
    from ninfer.engine.engine import CPU_AUTO_SEQS, LLMEngine
    for seqs in (2, 64):
        eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", max_context=1000, max_num_seqs=seqs),
                        progress=False)
        pages = -(-1000 // PAGE_SIZE) * min(seqs, CPU_AUTO_SEQS)
        assert eng.kv_capacity_tokens == pages * PAGE_SIZE, eng.startup_lines


def test_threads_flag_env_and_user_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninfer.engine import cpu
    before = torch.get_num_threads()
    try:
        assert cpu.configure_threads(1) == (1, "--threads") and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="--threads must be >= 1"):
            cpu.configure_threads(0)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cpu.configure_threads(None)[1] == "OMP_NUM_THREADS"
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(cpu, "_ours", [])
        monkeypatch.setattr(cpu, "_default_threads", 99)   # torch's count differs from its start value
        assert cpu.configure_threads(None) == (torch.get_num_threads(), "torch.set_num_threads")
        monkeypatch.setattr(cpu, "_default_threads", torch.get_num_threads())
        monkeypatch.setattr(cpu.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        assert cpu.configure_threads(None) == (cpu.physical_cores(), "physical cores")
        monkeypatch.setattr(cpu.os, "getloadavg", lambda: (50.0, 0.0, 0.0))   # every core busy: one thread
        n, why = cpu.configure_threads(None)
        assert n == 1 and (why == "physical cores" if cpu.physical_cores() == 1 else "load 50.0" in why)
    finally:
        torch.set_num_threads(before)
