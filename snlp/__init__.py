"""snlp: layer-parallel inference of Transformer language models (Structured Newton Layer Parallelism)."""

from .checkpoint import load, save_checkpoint
from .analysis import early_exit
from .evaluation import EvalConfig, EvalRecord, evaluate
from .mc import MCConfig, MCResult, evaluate_mc
from .sft import SFTConfig, sft
from .train import TrainConfig, TrainResult, fit
from .fusion import ChunkWeights, HCChunkWeights, build_chunk_weights, chunk_forward, chunk_weights
from .hf import export_hf, from_hf
from .model import GPT, GPTConfig
from .correction import HCN, DiagN, Identity, Jacobi, Newton, Surrogate
from .plan import Plan, parse_plans
from .tokenizer import Tokenizer
from .solver import (Runner, SNLPDivergenceError, SolveResult, bind, fused_forward, fused_sequential,
                     parallel_forward, permuted_sequential, solve)

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "Plan", "parse_plans", "bind", "Runner", "solve", "parallel_forward",
           "Surrogate", "Identity", "Jacobi", "HCN", "DiagN", "Newton", "fused_sequential",
           "fused_forward", "permuted_sequential", "SolveResult", "SNLPDivergenceError", "ChunkWeights",
           "HCChunkWeights", "build_chunk_weights", "chunk_forward", "chunk_weights", "load", "save_checkpoint",
           "Tokenizer", "EvalConfig", "EvalRecord", "evaluate", "early_exit", "TrainConfig", "TrainResult", "fit",
           "SFTConfig", "sft", "MCConfig", "MCResult", "evaluate_mc", "from_hf", "export_hf", "__version__"]
