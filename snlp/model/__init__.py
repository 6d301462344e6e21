"""The Transformer: configuration, the nanochat-style / Llama-family / mHC GPT, its static KV cache and a
fingerprint of its weights."""

from snlp.runtime.lazy import lazy_exports

__all__ = ["GPT", "GPTConfig", "KVCache", "weights_fingerprint"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.model.cache": "KVCache",
    "snlp.model.fingerprint": "weights_fingerprint",
    "snlp.model.gpt": "GPT GPTConfig",
})
