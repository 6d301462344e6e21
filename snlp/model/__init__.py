"""The Transformer: configuration, the nanochat-style / Llama-family / mHC GPT, its static KV cache and a
fingerprint of its weights."""

from snlp.model.cache import KVCache
from snlp.model.fingerprint import weights_fingerprint
from snlp.model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "KVCache", "weights_fingerprint"]
