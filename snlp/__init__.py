"""snlp: layer-parallel inference of Transformer language models (Structured Newton Layer Parallelism)."""

from snlp.io.checkpoint import load, save_checkpoint
from snlp.eval.analysis import early_exit
from snlp.eval.protocol import EvalConfig, EvalRecord, evaluate
from snlp.eval.mc import MCConfig, MCResult, evaluate_mc
from snlp.train.sft import SFTConfig, sft
from snlp.train.config import TrainConfig, TrainResult
from snlp.train.trainer import fit
from snlp.method.fusion import ChunkWeights, HCChunkWeights, build_chunk_weights, chunk_forward, chunk_weights
from snlp.io.hf import export_hf, from_hf
from snlp.model.gpt import GPT, GPTConfig
from snlp.method.surrogates import HCN, DiagN, Identity, Jacobi, Newton, Surrogate
from snlp.method.plan import Plan, parse_plans
from snlp.io.tokenizer import Tokenizer
from snlp.method.solver import (Runner, SNLPDivergenceError, SolveResult, bind, fused_forward, fused_sequential,
                     parallel_forward, permuted_sequential, solve)

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "Plan", "parse_plans", "bind", "Runner", "solve", "parallel_forward",
           "Surrogate", "Identity", "Jacobi", "HCN", "DiagN", "Newton", "fused_sequential",
           "fused_forward", "permuted_sequential", "SolveResult", "SNLPDivergenceError", "ChunkWeights",
           "HCChunkWeights", "build_chunk_weights", "chunk_forward", "chunk_weights", "load", "save_checkpoint",
           "Tokenizer", "EvalConfig", "EvalRecord", "evaluate", "early_exit", "TrainConfig", "TrainResult", "fit",
           "SFTConfig", "sft", "MCConfig", "MCResult", "evaluate_mc", "from_hf", "export_hf", "__version__"]
