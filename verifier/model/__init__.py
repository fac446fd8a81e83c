"""Target models: a Llama-family decoder, its KV cache, and loading from GGUF or HF safetensors."""

from .config import ModelConfig, RopeScaling
from .kv_cache import KVCache
from .loader import LoadedModel, build_model, load_model, resolve_model_path
from .tokenizer import TextCodec
from .transformer import ForwardBatch, Transformer

__all__ = ["ForwardBatch", "KVCache", "LoadedModel", "ModelConfig", "RopeScaling", "TextCodec", "Transformer",
           "build_model", "load_model", "resolve_model_path"]
