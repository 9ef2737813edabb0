"""The bundled probe model: synthetic long-document retrieval data (data.py), its tokenizer
(tokenizer.py), training (train.py), picking the best run (pick.py) and a transformers-based
reference evaluation (evaluate.py).

    python -m ninfer.tools.probe.train --out DIR [--minutes M] [--device cuda]
    python -m ninfer.tools.probe.pick --out DIR --report FILE RUN_DIR [RUN_DIR ...]"""
from __future__ import annotations

from pathlib import Path

from ninfer.config import DEFAULT_MODEL_DIR


def repo_root() -> Path:
    """The repository root: the parent of the `ninfer` package directory."""
    return DEFAULT_MODEL_DIR.parent.parent


def default_model_dir() -> Path:
    """models/probe/ in the repository: the model used when none is named."""
    return DEFAULT_MODEL_DIR
