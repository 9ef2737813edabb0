"""CLI table and engine-flag parsing: vLLM aliases map to the same fields, token counts parse as
binary units whatever the case (4k = 4K = 4096), and unknown commands fail with exit code 2."""
from __future__ import annotations

import argparse

import pytest

from ninfer import cli
from ninfer.config import EngineConfig, add_engine_args, engine_config_from_args, parse_token_count


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("4k", 4096), ("4K", 4096), ("32k", 32768),
                                           ("1m", 1 << 20), ("1M", 1 << 20), ("1.5k", 1536), ("1g", 1 << 30)])
def test_parse_token_count(text, expected):
    assert parse_token_count(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "-5", "0", "12q"])
def test_parse_token_count_rejects(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_token_count(bad)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(argv))


def test_vllm_aliases_equal_native_flags():
    native = _parse(["m", "--kv-dtype", "int8", "--max-context", "32K", "--no-cuda-graph",
                     "--no-prefix-reuse", "--max-concurrency", "3"])
    alias = _parse(["m", "--kv-cache-dtype", "int8", "--max-model-len", "32768", "--enforce-eager",
                    "--no-enable-prefix-caching", "--max-num-seqs", "3"])
    assert native == alias
    assert native.kv_dtype == "int8" and native.max_context == 32768 and native.enforce_eager
    assert not native.enable_prefix_caching and native.max_num_seqs == 3


def test_defaults():
    cfg = _parse([])
    assert cfg == EngineConfig()
    assert cfg.kv_dtype == "rk4v4-e8" and cfg.kv_capacity == "auto" and cfg.enable_prefix_caching


def test_kv_capacity_and_memory_limit():
    cfg = _parse(["--kv-capacity", "128k", "--memory-limit", "32"])
    assert cfg.kv_capacity == 131072 and cfg.memory_limit_gib == 32.0
    with pytest.raises(SystemExit):
        _parse(["--memory-limit", "-1"])


def test_unknown_command_exit_code(capsys):
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli.main(["bench", "no-such-bench"]) == 2


def test_version(capsys):
    from ninfer import __version__
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ninfer {__version__}"


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_help_is_whole(command, capsys):
    """The description is the module's whole first paragraph, and every option says what it does."""
    import importlib
    mod = importlib.import_module(cli.COMMANDS[command][0])
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse re-wraps (also at hyphens)
    text = cli.description(mod.__doc__)
    assert "".join(text.split()) in out and text.endswith(".")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    missing = [a.option_strings or a.dest for a in p._actions if not a.help]
    assert not missing, missing


def test_plan_warns_past_the_model_window(tmp_path, capsys):
    import json
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}))
    cli.main(["plan", str(tmp_path), "--max-context", "1M", "--kv-dtype", "int8"])
    err = capsys.readouterr().err
    assert "warning: max_context=1048576 exceeds the model's 32768 positions" in err
    cli.main(["plan", str(tmp_path), "--max-context", "32K", "--kv-dtype", "int8"])
    assert "warning" not in capsys.readouterr().err
