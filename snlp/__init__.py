"""snlp: layer-parallel inference of Transformer language models (Structured Newton Layer Parallelism)."""

from .checkpoint import load, save_checkpoint
from .diagnostics import early_exit
from .eval import EvalConfig, evaluate
from .fusion import ChunkWeights, HCChunkWeights, build_chunk_weights, chunk_forward, chunk_weights
from .hf import export_hf, from_hf
from .model import GPT, GPTConfig
from .plan import Plan, parse_plans
from .tokenizer import Tokenizer
from .solver import SNLPDivergenceError, SolveResult, fused_forward, fused_sequential, parallel_forward, solve

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "Plan", "parse_plans", "solve", "parallel_forward", "fused_sequential",
           "fused_forward", "SolveResult", "SNLPDivergenceError", "ChunkWeights", "HCChunkWeights", "build_chunk_weights",
           "chunk_forward", "chunk_weights", "load", "save_checkpoint", "Tokenizer", "EvalConfig", "evaluate",
           "early_exit", "from_hf", "export_hf", "__version__"]
