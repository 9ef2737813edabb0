"""The whole engine on CUDA (Triton store/prefill, CUDA/Triton decode, CUDA graphs) against the
same engine on CPU with the torch reference backend, on a tiny random-weight checkpoint. Run on
the GPU machine (`python3 -m pytest -q tests/test_gpu_engine.py`); skipped without CUDA.

Teacher-forced along the CPU run's greedy tokens, so every step compares logits after the same
history; the bound is the kernels' bf16-operand error, far below what a wrong page, slot,
rotation or coset would cause (those give O(1) logit errors)."""
from __future__ import annotations

import pytest
import torch

from ninfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT_LENS = (70, 150, 333)
NEW_TOKENS = 12


def _run(path, device: str, kv_dtype: str, forced=None, eager: bool = False):
    llm = LLM(str(path), kv_dtype=kv_dtype, device=device, max_context=1024, kv_capacity=4096,
              max_num_batched_tokens=128, dtype="fp32", enforce_eager=eager, enable_prefix_caching=False)
    rows: dict[str, list[torch.Tensor]] = {}

    def hook(reqs, logits):
        for j, r in enumerate(reqs):
            rows.setdefault(r.request_id, []).append(logits[j].float().cpu().clone())
            if forced is not None:
                logits[j] = -1e30
                logits[j, forced[int(r.request_id)][r.num_output_tokens]] = 0.0

    llm.engine.logits_hook = hook
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, n in enumerate(PROMPT_LENS):
        llm.engine.add_request(str(i), torch.randint(4, 300, (n,), generator=g).tolist(), params)
    toks: dict[int, list[int]] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                toks[int(out.request_id)] = list(out.token_ids)
    return [toks[i] for i in range(len(PROMPT_LENS))], [torch.stack(rows[str(i)]) for i in range(len(PROMPT_LENS))]


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "int8", "rk4v4", "rk4v4-e8"])
@pytest.mark.parametrize("geom", [dict(arch="qwen3", hidden=64, heads=6, kv_heads=1, head_dim=256),
                                  dict(arch="llama", hidden=128, heads=4, kv_heads=2, head_dim=128)],
                         ids=["qwen3-d256-g6", "llama-d128-g2"])
def test_cuda_engine_matches_cpu_reference(tiny_checkpoint, kv_dtype, geom):
    path = tiny_checkpoint(**geom)
    ref_toks, ref_logits = _run(path, "cpu", kv_dtype)
    _, gpu_logits = _run(path, "cuda", kv_dtype, forced=ref_toks)
    for r, g in zip(ref_logits, gpu_logits):
        err = (g - r).norm() / r.norm()
        assert err < 3e-2, f"{kv_dtype}: relative logit error {err:.3g}"


def test_cuda_graphs_equal_eager(tiny_checkpoint):
    path = tiny_checkpoint(arch="qwen3", hidden=64, heads=6, kv_heads=1, head_dim=256)
    toks_graph, logits_graph = _run(path, "cuda", "rk4v4-e8")
    _, logits_eager = _run(path, "cuda", "rk4v4-e8", forced=toks_graph, eager=True)
    for a, b in zip(logits_graph, logits_eager):
        assert torch.allclose(a, b, rtol=0, atol=1e-3), (a - b).abs().max()
