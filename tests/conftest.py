"""Shared fixtures: tiny random-weight HF checkpoints (see tests/tiny_models.py), written once per
test session and cached by their arguments."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `from tests.tiny_models import ...`

from tests.tiny_models import make_checkpoint  # noqa: E402

# Tests use tiny shapes: intra-op threads only add spin-waiting, which on a shared 2-core machine
# made a 70-token forward ~50x slower. NINFER_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("NINFER_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(**make_checkpoint_kwargs) -> Path`, cached per session by its arguments.
    Treat the directory as read-only (it is shared); copy it to damage it."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("tiny_ckpts")

    def get(**kwargs: Any) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            cache[key] = make_checkpoint(root, name=f"ckpt{len(cache)}", **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    """The default tiny Qwen3 (hidden 64, 2 layers, 6 q heads / 1 kv head, head_dim 64, fp32)."""
    return tiny_checkpoint()


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch):
    """`as_rank(rank, size)`: this process builds and loads as that tensor-parallel rank (construction
    and loading run no collective, so no group is needed)."""
    from ninfer.distributed import parallel_state as ps

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(ps, "_RANK", rank)
        monkeypatch.setattr(ps, "_SIZE", size)
    return set_rank


@pytest.fixture(scope="session")
def kv_sim_model(tiny_checkpoint: Callable[..., Path]):
    """(path, transformers model, tokenizer) of the tiny Qwen3 the KV-codec simulation tests share."""
    from ninfer.bench import kv_sim
    path = tiny_checkpoint(arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=384)
    m, tok = kv_sim.load(str(path))
    return path, m, tok
