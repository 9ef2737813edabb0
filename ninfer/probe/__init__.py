"""The bundled probe model: synthetic long-document retrieval data (data.py), its tokenizer
(tokenizer.py), training (train.py) and a transformers-based reference evaluation (evaluate.py)."""
from __future__ import annotations

from pathlib import Path


def repo_root() -> Path:
    """The repository root: the parent of the `ninfer` package directory."""
    return Path(__file__).resolve().parent.parent.parent


def default_model_dir() -> Path:
    """models/probe/ in the repository: the model used when none is named."""
    return repo_root() / "models" / "probe"
