"""The method (paper Sec. "Method"): plans, surrogates with their math (Jacobian estimates, scans), fused chunk
weights, the SNLP solve and its bound Runner, and the preheat calibration."""

from snlp.runtime.lazy import lazy_exports

__all__ = ["Plan", "parse_plans", "Surrogate", "Identity", "Jacobi", "HCN", "DiagN", "Newton", "ChunkWeights",
           "HCChunkWeights", "build_chunk_weights", "chunk_forward", "chunk_weights", "solve", "bind", "Runner",
           "parallel_forward", "SolveResult", "SNLPDivergenceError", "fused_forward", "fused_sequential",
           "permuted_sequential", "Preheat", "CalibrateConfig", "fit_preheat"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.method.fusion": "ChunkWeights HCChunkWeights build_chunk_weights chunk_forward chunk_weights",
    "snlp.method.plan": "Plan parse_plans",
    "snlp.method.preheat": "CalibrateConfig Preheat fit_preheat=fit",
    "snlp.method.solver": "Runner SNLPDivergenceError SolveResult bind fused_forward fused_sequential "
                          "parallel_forward permuted_sequential solve",
    "snlp.method.surrogates": "HCN DiagN Identity Jacobi Newton Surrogate",
})
