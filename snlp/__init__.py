"""snlp: layer-parallel inference of Transformer language models (Structured Newton Layer Parallelism).

The public API is this screen; everything else is importable from its sub-package (docs/architecture.md):
snlp.model, snlp.method, snlp.io, snlp.decode, snlp.train, snlp.eval, snlp.dist, snlp.bench, snlp.apps."""

from snlp.runtime.lazy import lazy_exports

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
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.decode.generate": "sequential_generate snlp_generate",
    "snlp.decode.jacobi": "jacobi_generate",
    "snlp.decode.session": "GenerateResult",
    "snlp.decode.speculative": "speculative_generate",
    "snlp.eval.protocol": "EvalConfig EvalRecord evaluate",
    "snlp.io.checkpoint": "load load_preheat save_checkpoint",
    "snlp.io.hf": "export_hf from_hf",
    "snlp.io.tokenizer": "Tokenizer",
    "snlp.method.plan": "Plan parse_plans",
    "snlp.method.preheat": "Preheat",
    "snlp.method.solver": "Runner SNLPDivergenceError SolveResult bind fused_forward fused_sequential "
                          "parallel_forward solve",
    "snlp.method.surrogates": "HCN DiagN Identity Jacobi Newton Surrogate",
    "snlp.model.gpt": "GPT GPTConfig",
})
