"""Decoding: static-shape steps, one decode session, ragged batches (snlp.decode.batch), and sequential / SNLP / self-speculative / Jacobi generation."""

from snlp.decode.generate import MODES, sequential_generate, snlp_generate
from snlp.decode.jacobi import jacobi_generate
from snlp.decode.session import GenerateResult, merge_results
from snlp.decode.speculative import (SpeculativeReport, SSDRow, ideal_ssd_speedup, speculative_accept,
                                     speculative_benchmark, speculative_generate, speculative_report,
                                     speculative_shootout)

__all__ = ["MODES", "GenerateResult", "merge_results", "sequential_generate", "snlp_generate", "jacobi_generate",
           "speculative_generate", "speculative_accept", "speculative_benchmark", "speculative_shootout",
           "speculative_report",
           "SpeculativeReport", "SSDRow", "ideal_ssd_speedup"]
