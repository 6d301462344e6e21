"""snlp: layer-parallel inference of Transformer language models (Structured Newton Layer Parallelism)."""

from .checkpoint import load, save_checkpoint
from .diagnostics import early_exit
from .evaluation import EvalConfig, EvalRecord, evaluate
from .fusion import ChunkWeights, build_chunk_weights, chunk_forward, chunk_weights
from .model import GPT, GPTConfig
from .plan import Plan, parse_plans
from .tokenizer import Tokenizer
from .solver import SNLPDivergenceError, SolveResult, fused_forward, fused_sequential, parallel_forward, solve

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "Plan", "parse_plans", "solve", "parallel_forward", "fused_sequential",
           "fused_forward", "SolveResult", "SNLPDivergenceError", "ChunkWeights", "build_chunk_weights",
           "chunk_forward", "chunk_weights", "load", "save_checkpoint", "Tokenizer", "EvalConfig",
           "EvalRecord", "evaluate", "early_exit", "__version__"]
