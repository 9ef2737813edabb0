"""The GDN layer's CUDA decode path (fla-core's fused_recurrent_gated_delta_rule, as the layer calls
it) against its float32 torch reference, run on the CPU under TRITON_INTERPRET=1 at tiny shapes:
one decode step of three sequences from random stored states (one a padding row, slot -1), GQA-
style value-head groups and equal head counts; outputs, conv and recurrent states compared.

fla's chunked prefill kernel (chunk_gated_delta_rule) does not run under Triton 3.6's interpreter
(chunk_gated_delta_rule_fwd_kernel_h_blockdim64 fails on an int where it expects a tensor), so it
is checked against the reference on the GPU only (tests/test_gpu_hybrid.py)."""
from __future__ import annotations

import sys
import time

from tests.triton_interp import case_result, child_main, module_results

CASES = [("gva-1k-2v", 1, 2, 0), ("equal-2k-2v", 2, 2, 2)]


def _run_case(name: str, hk: int, hv: int, seed: int) -> dict:
    import torch
    from triton.runtime import autotuner

    from ninfer.layers.gdn import GatedDeltaNet
    from tests.tiny_models import build_metadata

    # the interpreter has no driver to time configs with: run the first config of each autotuner
    orig = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return orig(self, *args, **kwargs)
    autotuner.Autotuner.run = first_config

    torch.manual_seed(seed)
    layer = GatedDeltaNet(32, hk, hv, 16, 16, 4, 1e-6, state_layer=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    slots = [2, 0, -1]
    states = {"conv": torch.randn(4, 3, layer.conv_dim), "ssm": torch.randn(4, hv, 16, 16)}
    x = torch.randn(3, 32)
    meta = build_metadata([1, 1, 1], [5, 9, 1], 16)
    meta.state_slots = torch.tensor(slots, dtype=torch.int32)
    meta.has_initial_state = torch.tensor([True, True, True])
    res = {"name": name}
    outs = {}
    for impl in ("torch", "fla"):
        st = {k: v.clone() for k, v in states.items()}
        backend = type("B", (), {"state": lambda self, i, st=st: st})()
        layer.impl = impl
        t0 = time.perf_counter()
        with torch.no_grad():
            outs[impl] = (layer(x, meta, backend), st)
        res[f"{impl}_seconds"] = round(time.perf_counter() - t0, 2)
    (o_ref, s_ref), (o, s) = outs["torch"], outs["fla"]
    res["out_diff"] = float((o[:2] - o_ref[:2]).abs().max())
    res["out_scale"] = float(o_ref.abs().max())
    res["ssm_diff"] = float((s["ssm"] - s_ref["ssm"]).abs().max())
    res["conv_equal"] = bool(torch.equal(s["conv"], s_ref["conv"]))
    res["untouched_equal"] = bool(torch.equal(s["ssm"][[1, 3]], states["ssm"][[1, 3]]))
    res["state_moved"] = float((s["ssm"][2] - states["ssm"][2]).abs().max())
    return res


results = module_results(__file__)


def test_fla_recurrent_decode_matches_reference(results) -> None:
    for name, *_ in CASES:
        r = case_result(results, name)
        assert r["out_diff"] < 1e-4 * max(1.0, r["out_scale"]), r
        assert r["ssm_diff"] < 1e-4 and r["conv_equal"] and r["untouched_equal"], r
        assert r["state_moved"] > 1e-3, r  # the step really wrote the state


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(child_main(CASES, _run_case))
