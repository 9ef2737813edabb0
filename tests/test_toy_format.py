"""A KV format added from one module outside the package (tests/toy_kv_format.py: fp8 e4m3, no
scales, no kernels) runs end to end: the registry finds it, the planner, pool and geometry line
derive from its planes, the reference backend serves it on CPU, and a kernel backend refuses it at
startup with the reason.

Parity bound: the engine with the toy format vs the same tiny random model with bf16 KV, the
logits of the first sampled token of prompts of 20..130 tokens (teacher-forced, so a changed greedy
token cannot hide or inflate an error), three prompt seeds. Measured on this model: toy max |dlogit|
0.118, KL 8.3e-4 (bf16 vs auto: 0.013 / 7.6e-6); the same bytes read back as e5m2 (a plausible
decoder bug, ``BROKEN_FP8``): 3.07 / 0.43. Bounds: max |dlogit| <= 0.4, KL <= 5e-3; the broken
variant must exceed both."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer import LLM, SamplingParams
from tests import toy_kv_format as toy

MAX_DLOGIT, MAX_KL = 0.4, 5e-3


@pytest.fixture(scope="module", autouse=True)
def registered():
    toy.register()
    yield
    toy.unregister()


def _first_logits(path: Path, kv: str, prompts: list[list[int]]) -> tuple[list[torch.Tensor], LLM]:
    llm = LLM(str(path), kv_dtype=kv, device="cpu", kv_capacity=2048, max_context=512)
    rows: dict[str, torch.Tensor] = {}
    llm.engine.logits_hook = lambda reqs, lg: rows.update({r.request_id: x.clone() for r, x in zip(reqs, lg)})
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    return [rows[o.request_id] for o in outs], llm


def _kl(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                            reduction="sum"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_toy_format_runs_the_engine_within_bound(tiny_model_dir: Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 380, (n,), generator=g).tolist() for n in (20, 40, 70, 130)]
    ref, _ = _first_logits(tiny_model_dir, "bf16", prompts)
    got, llm = _first_logits(tiny_model_dir, "toy-fp8", prompts)
    bad, _ = _first_logits(tiny_model_dir, "toy-fp8-misread", prompts)
    err = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    kl = max(_kl(b, a) for a, b in zip(got, ref))
    assert err <= MAX_DLOGIT and kl <= MAX_KL, f"toy-fp8 vs bf16 KV: max |dlogit| {err:.3g}, KL {kl:.3g}"
    bad_err = max(float((a - b).abs().max()) for a, b in zip(bad, ref))
    bad_kl = max(_kl(b, a) for a, b in zip(bad, ref))
    assert bad_err > MAX_DLOGIT and bad_kl > MAX_KL, "the bound would not catch a misread decoder"

    # everything else derived from the format's planes
    eng = llm.engine
    assert eng.kv_format is toy.TOY_FP8 and eng.backend.name == "reference"
    d, hkv, layers = eng.model_config.head_dim, eng.model_config.num_kv_heads, eng.model_config.num_layers
    assert eng.plan.bytes_per_token == 2 * d * hkv * layers == eng.pool.bytes_per_token  # 1 byte per K/V value
    assert eng.pool.layers[0]["k"].dtype == torch.float8_e4m3fn and set(eng.pool.layers[0]) == {"k", "v"}
    assert any(line.startswith("kv planes: kv_dtype=toy-fp8 packed_k=0") and "dtype=float8_e4m3fn scales=none"
               in line for line in eng.startup_lines)


def test_kernel_backend_refuses_a_format_without_kernels(tiny_model_dir: Path) -> None:
    from ninfer.attention.selector import UnsupportedAttention, select_backend
    from ninfer.kvcache.pool import KVCachePool

    pool = KVCachePool(toy.TOY_FP8, 1, 2, 64, 4)
    with pytest.raises(UnsupportedAttention, match=r"no store implementation serves kv_dtype=toy-fp8 .*"
                                                   r"cuda: format toy-fp8 has no cuda store kernel; triton: format "
                                                   r"toy-fp8 has no triton store kernel"):
        select_backend(pool, "cpu", torch.bfloat16, 4, kind="kernels")
    assert select_backend(pool, "cpu", torch.bfloat16, 4).name == "reference"


def test_registry_rules() -> None:
    from ninfer.kvcache.formats import FORMAT_NAMES, format_names, get_format, register_format

    assert get_format("TOY-FP8") is toy.TOY_FP8 and get_format(toy.TOY_FP8) is toy.TOY_FP8
    assert "toy-fp8" in format_names() and "toy-fp8" not in FORMAT_NAMES  # CLI choices stay the built-ins
    register_format(toy.TOY_FP8)  # the same object again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_format(toy.Fp8Format("toy-fp8", "another"))
    with pytest.raises(ValueError, match="refused"):
        register_format(toy.Fp8Format("rk2v4-e8"))
    with pytest.raises(ValueError, match="lower case"):
        register_format(toy.Fp8Format("Toy"))
    with pytest.raises(TypeError):
        register_format("toy")  # type: ignore[arg-type]
