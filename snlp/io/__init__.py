"""In and out: checkpoints, tokenizers, training data, chat data, multiple-choice task data, Hugging Face models."""

from snlp.io.checkpoint import load, load_preheat, save_checkpoint
from snlp.io.hf import export_hf, from_hf
from snlp.io.tokenizer import Tokenizer

__all__ = ["load", "save_checkpoint", "load_preheat", "Tokenizer", "from_hf", "export_hf"]
