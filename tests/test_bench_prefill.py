"""`ninfer bench prefill` on CPU with a tiny checkpoint: ninfer and the transformers peer on the same
prompts side by side, and the model-FLOPs count behind "% of ideal" against the checkpoint's own
linear layers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ninfer import cli
from ninfer.bench import prefill as bp


@pytest.mark.slow  # two engines (ninfer, transformers) on CPU: ~40 s
def test_bench_prefill_with_transformers_peer(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    rc = cli.main(["bench", "prefill", str(tiny_model_dir), "--device", "cpu", "--max-num-batched-tokens", "128",
                   "--max-concurrency", "1", "--kv-dtype", "int8", "--prompt-tokens", "150,70", "--repeats", "2",
                   "--peer", "transformers", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["bench"] == "prefill" and d["ok"] and d["settings"]["prefix_reuse"] is False
    assert d["settings"]["prompt_tokens"] == [70, 150] and "kernels" not in d  # no kernel table on CPU
    assert set(d["e2e"]) == {"ninfer int8", "transformers"}
    for name, res in d["e2e"].items():
        rows = res["rows"]
        assert [r.get("prompt_tokens", r.get("n")) for r in rows] == [70, 150], name
        for r in rows:
            assert len(r["ttft_s"]) == 2 and all(t > 0 for t in r["ttft_s"])
            assert math.isclose(r["prefill_tok_s"], r.get("prompt_tokens", r.get("n")) / r["ttft_median_s"])
    assert "prefix_reuse=0" in d["e2e"]["ninfer int8"]["engine"]["startup_lines"][-1]
    # 150 tokens in 128-token chunks: two steps; the prompts differ per repeat (heads varied)
    p = bp.prompts_for(1000, 150, 2, 0)
    assert p[0][64:] == p[1][64:] and p[0][:64] != p[1][:64]


def test_model_flops_match_the_checkpoint_linears(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from ninfer.model_config import ModelConfig

    mc = ModelConfig.load(str(tiny_model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    per_tok = sum(2 * m.in_features * m.out_features for m in hf.model.layers.modules()
                  if isinstance(m, torch.nn.Linear))
    lm = 2 * hf.lm_head.in_features * hf.lm_head.out_features  # logits of the last token only
    n = 37
    pairs = sum(i + 1 for i in range(n))  # causal (query, key) pairs
    attn = mc.num_layers * 4 * mc.num_heads * mc.head_dim * pairs
    assert bp.model_prefill_flops(mc, n) == per_tok * n + attn + lm
