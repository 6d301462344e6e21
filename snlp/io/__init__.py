"""In and out: checkpoints, tokenizers, training data, chat data, multiple-choice task data, Hugging Face models."""

from snlp.runtime.lazy import lazy_exports

__all__ = ["load", "save_checkpoint", "load_preheat", "Tokenizer", "from_hf", "export_hf"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.io.checkpoint": "load load_preheat save_checkpoint",
    "snlp.io.hf": "export_hf from_hf",
    "snlp.io.tokenizer": "Tokenizer",
})
