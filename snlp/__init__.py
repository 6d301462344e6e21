"""snlp: layer-parallel inference of Transformer language models (Structured Newton Layer Parallelism).

The public API is this screen; everything else is importable from its sub-package (docs/architecture.md):
snlp.model, snlp.method, snlp.io, snlp.decode, snlp.train, snlp.eval, snlp.dist, snlp.bench, snlp.apps."""

from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.decode.jacobi import jacobi_generate
from snlp.decode.session import GenerateResult
from snlp.decode.speculative import speculative_generate
from snlp.eval.protocol import EvalConfig, EvalRecord, evaluate
from snlp.io.checkpoint import load, load_preheat, save_checkpoint
from snlp.io.hf import export_hf, from_hf
from snlp.io.tokenizer import Tokenizer
from snlp.method.plan import Plan, parse_plans
from snlp.method.preheat import Preheat
from snlp.method.solver import (Runner, SNLPDivergenceError, SolveResult, bind, fused_forward, fused_sequential,
                                parallel_forward, solve)
from snlp.method.surrogates import HCN, DiagN, Identity, Jacobi, Newton, Surrogate
from snlp.model.gpt import GPT, GPTConfig

__version__ = "0.1.0"
__all__ = [
    # the model and the method
    "GPT", "GPTConfig", "Plan", "parse_plans", "Surrogate", "Identity", "Jacobi", "HCN", "DiagN", "Newton",
    "solve", "bind", "Runner", "parallel_forward", "SolveResult", "SNLPDivergenceError", "fused_forward",
    "fused_sequential", "Preheat",
    # decoding
    "sequential_generate", "snlp_generate", "speculative_generate", "jacobi_generate", "GenerateResult",
    # checkpoints and Hugging Face models
    "load", "save_checkpoint", "load_preheat", "Tokenizer", "from_hf", "export_hf",
    # the paper's metrics
    "evaluate", "EvalConfig", "EvalRecord", "__version__",
]
