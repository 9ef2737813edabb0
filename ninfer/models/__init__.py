"""Model architectures, one file per HF family (llama.py: Llama/Mistral, qwen2.py, qwen3.py), the
lazy registry (architecture name -> class) and the safetensors loader."""
from ninfer.models.base import CausalLM
from ninfer.models.loader import CheckpointError, load_model, load_tokenizer
from ninfer.models.registry import ARCHITECTURES, get_model_class

__all__ = ["ARCHITECTURES", "CausalLM", "CheckpointError", "get_model_class", "load_model", "load_tokenizer"]
