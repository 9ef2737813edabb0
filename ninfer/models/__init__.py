"""Model architectures (shared dense decoder + registry), RoPE, and the safetensors loader."""
from ninfer.models.decoder import CausalLM
from ninfer.models.loader import CheckpointError, load_model, load_tokenizer
from ninfer.models.registry import ARCHITECTURES, get_arch_spec

__all__ = ["ARCHITECTURES", "CausalLM", "CheckpointError", "get_arch_spec", "load_model", "load_tokenizer"]
