"""ninfer: long-context LLM inference with an E8-lattice 4-bit KV cache."""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import ninfer` (CLI, planner) does not import the engine and torch models.
    if name == "LLM":
        from ninfer.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from ninfer.engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
