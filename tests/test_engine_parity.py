"""Engine vs transformers on tiny random-weight checkpoints: fp32 weights and compute, unquantized
KV (kv_dtype="auto" = model dtype): greedy tokens identical to `generate` for 32+ new tokens and
every step's logits within 1e-4 — single prompt, chunked prefill, a batch of prompts of different
lengths, a prefix-reuse hit, and YaRN. bf16 KV cannot meet 1e-4 against an fp32 oracle; it is
measured by KL in test_engine_kl.py like the quantized formats."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from ninfer import LLM, SamplingParams
from ninfer.engine.request import Request

NEW_TOKENS = 32
ATOL = 1e-4

# (name, make_checkpoint kwargs). Every architecture, head_dim 64/128/256, GQA groups 1..6.
GEOMETRIES = {
    "qwen3-d64-g6": dict(arch="qwen3", hidden=64, heads=6, kv_heads=1, head_dim=64),
    "qwen3-d256-g6": dict(arch="qwen3", hidden=64, heads=6, kv_heads=1, head_dim=256),
    "llama-d128-g2": dict(arch="llama", hidden=128, heads=4, kv_heads=2, head_dim=128),
    "qwen2-d64-g2": dict(arch="qwen2", hidden=128, heads=2, kv_heads=1, head_dim=64),
    "mistral-d64-g1": dict(arch="mistral", hidden=64, heads=2, kv_heads=2, head_dim=64, tie_word_embeddings=True),
}
YARN = dict(arch="qwen3", hidden=64, heads=4, kv_heads=2, head_dim=64, max_position=1024,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})

_HF: dict[Path, torch.nn.Module] = {}


def hf_model(path: Path) -> torch.nn.Module:
    if path not in _HF:
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        m.generation_config.eos_token_id = None  # ignore_eos on our side: never stop early
        _HF[path] = m.eval()
    return _HF[path]


def hf_greedy(path: Path, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    m = hf_model(path)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([x[0] for x in out.logits]).float()


def make_llm(path: Path, **kw) -> LLM:
    kw = {"kv_capacity": 4096, "max_context": 1024, **kw}
    llm = LLM(str(path), kv_dtype=kw.pop("kv_dtype", "auto"), device="cpu", **kw)
    llm.logits = {}  # request_id -> list of logits rows, filled by the hook

    def hook(reqs: list[Request], logits: torch.Tensor) -> None:
        for r, row in zip(reqs, logits):
            llm.logits.setdefault(r.request_id, []).append(row.clone())

    llm.engine.logits_hook = hook
    return llm


def run(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[tuple[list[int], torch.Tensor, int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [(o.token_ids, torch.stack(llm.logits[o.request_id]), o.num_cached_tokens) for o in outs]


def prompt_ids(n: int, seed: int, vocab: int = 380) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def check(path: Path, prompt: list[int], got: tuple[list[int], torch.Tensor, int]) -> None:
    ref_tokens, ref_logits = hf_greedy(path, prompt)
    tokens, logits, _ = got
    assert tokens == ref_tokens, f"greedy tokens differ from transformers at step " \
                                 f"{next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)}"
    err = float((logits - ref_logits).abs().max())
    assert err < ATOL, f"max |logit - transformers| = {err:.3g}"


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_single_prompt_and_batch(tiny_checkpoint: Callable[..., Path], name: str) -> None:
    path = tiny_checkpoint(**GEOMETRIES[name])
    llm = make_llm(path)
    prompts = [prompt_ids(n, seed=n) for n in (7, 40, 70, 131)]
    # one alone, then all four together (different lengths share every step)
    check(path, prompts[1], run(llm, [prompts[1]])[0])
    for p, got in zip(prompts, run(llm, prompts)):
        check(path, p, got)


def test_string_prompt_matches_token_ids(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.get_tokenizer().encode(text)
    a = llm.generate(text, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    b = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert a.prompt_token_ids == ids and a.token_ids == b.token_ids and a.text == b.text


def test_chunked_prefill(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(**GEOMETRIES["qwen3-d64-g6"])
    # 48-token budget: a 150-token prompt is prefilled in 4 chunks that straddle page boundaries,
    # and the second prompt's chunks share steps with the first one's decode
    llm = make_llm(path, max_num_batched_tokens=48)
    prompts = [prompt_ids(150, seed=1), prompt_ids(100, seed=2)]
    for p, got in zip(prompts, run(llm, prompts)):
        check(path, p, got)


def test_prefix_reuse_hit(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(**GEOMETRIES["qwen3-d64-g6"])
    llm = make_llm(path)
    shared = prompt_ids(140, seed=3)
    first = shared + prompt_ids(10, seed=4)
    second = shared + prompt_ids(25, seed=5)
    check(path, first, run(llm, [first])[0])
    got = run(llm, [second])[0]
    assert got[2] == 128, f"expected the 2 full shared pages (128 tokens) from the prefix cache, got {got[2]}"
    s = llm.engine.stats()
    assert s.prefix_cache_hits == 128 and s.prefix_cache_queries == len(first) + len(second)
    check(path, second, got)
    # and with reuse disabled nothing is served from cache, with the same result
    off = make_llm(path, enable_prefix_caching=False)
    run(off, [first])
    again = run(off, [second])[0]
    assert again[2] == 0 and again[0] == got[0]


def test_yarn(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(**YARN)
    llm = make_llm(path)
    assert "rope=yarn" in llm.startup_lines[0]
    p = prompt_ids(300, seed=6)  # past the original 256-token window
    check(path, p, run(llm, [p])[0])
    # the same weights without rope scaling in config.json + the CLI's --rope-yarn-factor flags
    plain = tiny_checkpoint(**{k: v for k, v in YARN.items() if k != "rope_scaling"})
    flags = make_llm(plain, rope_yarn_factor=4.0, rope_original_max_position=256)
    assert "rope=yarn factor=4.0 original_max_position_embeddings=256" in flags.startup_lines[0]
    check(path, p, run(flags, [p])[0])


# ---------------------------------------------------------------------------- startup and CLI

def test_startup_lines_geometry_and_capacity(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_dtype="rk4v4-e8", device="cpu", max_context=1024, kv_capacity=4096)
    lines = "\n".join(llm.startup_lines)
    assert ("kv planes: kv_dtype=rk4v4-e8 packed_k=1 packed_v=1 e8_lattice=1 e8_root=0 extent=64->32 "
            "dtype=uint8 scales=fp16x1") in lines
    assert "KV capacity explicit resolved=4096 tokens pages=64 bytes/token=136 " in lines
    assert "\nkernels: reference\n" in lines  # what computes attention (CUDA: decode=/store=/prefill=)
    planes = llm.engine.pool.layers[0]
    assert planes["k"].dtype == torch.uint8 and planes["k"].shape[-1] == 32  # really packed


def test_refuses_what_does_not_fit_before_loading(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ninfer.engine.rank as engine_mod   # where every rank loads its weights
    from ninfer.kvcache.planner import ContextDoesNotFit

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the memory plan refused")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    with pytest.raises(ContextDoesNotFit) as e:
        LLM(str(tiny_model_dir), kv_dtype="int8", device="cpu", max_context=4096, memory_limit=0.05)
    assert "does not fit with kv_dtype=int8" in str(e.value) and e.value.largest_context < 4096
    with pytest.raises(ValueError, match="rk2v4-e8 is refused"):
        LLM(str(tiny_model_dir), kv_dtype="rk2v4-e8", device="cpu")


def test_generate_cli(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from ninfer.cli import main
    rc = main(["generate", str(tiny_model_dir), "--prompt", "hello world", "--chat", "--greedy", "--max-tokens", "6",
               "--ignore-eos", "--device", "cpu", "--max-context", "1K", "--kv-capacity", "2K", "--kv-dtype", "int8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "kv planes: kv_dtype=int8" in err and "KV capacity explicit" in err
    llm = LLM(str(tiny_model_dir), kv_dtype="int8", device="cpu", max_context=1024, kv_capacity=2048)
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    ref = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out == ref.text + "\n"


if __name__ == "__main__":  # the docs/ENGINE.md parity table
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tiny_models import make_checkpoint

    torch.set_num_threads(1)

    def row(name: str, case: str, path: Path, prompts: list[list[int]], llm: LLM) -> None:
        got = run(llm, prompts)
        same = total = 0
        err = 0.0
        for p, (tokens, logits, _) in zip(prompts, got):
            ref_tokens, ref_logits = hf_greedy(path, p)
            same += sum(a == b for a, b in zip(tokens, ref_tokens))
            total += len(ref_tokens)
            err = max(err, float((logits - ref_logits).abs().max()))
        lens = "+".join(str(len(p)) for p in prompts)
        if case == "prefix hit":
            case += f" ({got[0][2]} tokens cached)"
        print(f"| {name} | {case} | {lens} | {same}/{total} | {err:.2e} |")

    with tempfile.TemporaryDirectory() as tmp:
        print("| checkpoint | case | prompt tokens | greedy tokens equal | max abs logit diff |")
        print("|---|---|---|---|---|")
        for name, kw in {**GEOMETRIES, "qwen3-d64-yarn4": YARN}.items():
            path = make_checkpoint(tmp, name=name, **kw)
            prompts = [prompt_ids(n, seed=n) for n in (7, 40, 70, 131)]
            row(name, "single", path, [prompts[1]], make_llm(path))
            row(name, "batch", path, prompts, make_llm(path))
            row(name, "chunked prefill (budget 48)", path, [prompt_ids(150, seed=1), prompt_ids(100, seed=2)],
                make_llm(path, max_num_batched_tokens=48))
            llm = make_llm(path)
            shared = prompt_ids(140, seed=3)
            run(llm, [shared + prompt_ids(10, seed=4)])
            row(name, "prefix hit", path, [shared + prompt_ids(25, seed=5)], llm)
            row(name, "long prompt", path, [prompt_ids(300, seed=6)], make_llm(path))


def test_cpu_generation_needs_no_triton(tiny_model_dir: Path) -> None:
    """Triton is an optional install (`pip install -e .`, README's main command, has none): on the CPU
    the engine must load and generate with it unimportable."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"  # any `import triton` now raises ImportError
            "from ninfer import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_model_dir)!r}, kv_dtype='rk4v4-e8', device='cpu', max_context=256, kv_capacity=512)\n"
            "p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)\n"
            "print('TOKENS', len(llm.generate([[1, 2, 3, 4]], p, use_tqdm=False)[0].token_ids))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(Path(__file__).resolve().parent.parent))
    assert res.returncode == 0 and "TOKENS 3" in res.stdout, res.stderr[-2000:]
