"""The method (paper Sec. "Method"): plans, surrogates with their math (Jacobian estimates, scans), fused chunk
weights, the SNLP solve and its bound Runner, and the preheat calibration."""

from snlp.method.fusion import ChunkWeights, HCChunkWeights, build_chunk_weights, chunk_forward, chunk_weights
from snlp.method.plan import Plan, parse_plans
from snlp.method.preheat import CalibrateConfig, Preheat, fit as fit_preheat
from snlp.method.solver import (Runner, SNLPDivergenceError, SolveResult, bind, fused_forward, fused_sequential,
                                parallel_forward, permuted_sequential, solve)
from snlp.method.surrogates import HCN, DiagN, Identity, Jacobi, Newton, Surrogate

__all__ = ["Plan", "parse_plans", "Surrogate", "Identity", "Jacobi", "HCN", "DiagN", "Newton", "ChunkWeights",
           "HCChunkWeights", "build_chunk_weights", "chunk_forward", "chunk_weights", "solve", "bind", "Runner",
           "parallel_forward", "SolveResult", "SNLPDivergenceError", "fused_forward", "fused_sequential",
           "permuted_sequential", "Preheat", "CalibrateConfig", "fit_preheat"]
