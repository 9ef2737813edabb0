"""Running Triton kernel checks on CPU under the interpreter, for every kernel test file.

Triton decides at ``@triton.jit`` time (module import) whether a kernel is interpreted, and other
test modules may already have imported Triton or ninfer's kernels in this pytest process. So each
kernel test file runs its checks in ONE child process started with ``TRITON_INTERPRET=1``
(``python tests/test_X.py --child``), which prints one ``CASE {json}`` line per case; the tests
assert on those lines. Independent of test order and of what the parent imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("auto", "bf16", "int8", "rk4v4", "rk4v4-e8")


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter calls ``int()`` on 1-element numpy arrays for run-time loop bounds,
    which numpy >= 2.4 refuses; give its tensors an ``__index__`` (interpreter only)."""
    from triton.runtime import interpreter as _interp

    orig = _interp._patch_lang_tensor
    if getattr(orig, "_ninfer_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ninfer_patched = True
    _interp._patch_lang_tensor = patched


def child_main(cases: Sequence[tuple], run_case: Callable[..., dict]) -> int:
    """The child's loop: run every case, print its result (or its error) as one JSON line."""
    sys.path.insert(0, str(ROOT))
    patch_interpreter_index()
    for case in cases:
        try:
            res = run_case(*case)
        except Exception as e:  # report, keep going
            res = {"name": case[0], "error": f"{type(e).__name__}: {e}"}
        print("CASE " + json.dumps(res), flush=True)
    return 0


def run_child(test_file: str, timeout: int = 600) -> dict:
    """Run ``test_file --child`` under TRITON_INTERPRET=1; collect its ``CASE {json}`` lines by name."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, test_file, "--child"], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            r = json.loads(line[5:])
            out[r["name"]] = r
    if not out:
        raise AssertionError(f"child produced no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


def module_results(test_file: str):
    """The module-scoped ``results`` fixture of a kernel test file: its child's cases, run once."""
    import pytest

    @pytest.fixture(scope="module")
    def results() -> dict:
        return run_child(test_file)
    return results


def case_result(results: dict, name: str) -> dict:
    """One case's result; fails when the child did not run it or the case raised."""
    r = results.get(name)
    assert r is not None, f"case {name} did not run"
    assert "error" not in r, r.get("error")
    return r


def exact_values(gen, shape, dtype, lo: int = -6, hi: int = 6):
    """Random values k/32 * 2^e (|k| < 256, e in [lo, hi] per 64-group): exact in bf16/fp16/fp32, and
    any float32 summation order of a 64-term +-1/8 rotation of them is exact (14 significant bits)."""
    import torch

    *lead, d = shape
    ng = -(-d // 64)
    gs = 2.0 ** torch.randint(lo, hi + 1, (*lead, ng), generator=gen).to(torch.float32)
    gs = gs.repeat_interleave(64, dim=-1)[..., :d]
    x = torch.round(torch.randn(*shape, generator=gen).clamp(-7.9, 7.9) * 32) / 32
    return (x * gs).to(dtype)
