"""Decoding: static-shape steps, one decode session, ragged batches (snlp.decode.batch), and sequential / SNLP / self-speculative / Jacobi generation."""

from snlp.runtime.lazy import lazy_exports

__all__ = ["MODES", "GenerateResult", "Sampling", "merge_results", "sequential_generate", "snlp_generate",
           "jacobi_generate",
           "speculative_generate", "speculative_accept", "speculative_benchmark", "speculative_shootout",
           "speculative_report",
           "SpeculativeReport", "SSDRow", "ideal_ssd_speedup"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.decode.generate": "MODES sequential_generate snlp_generate",
    "snlp.decode.jacobi": "jacobi_generate",
    "snlp.decode.session": "GenerateResult Sampling merge_results",
    "snlp.decode.speculative": "SpeculativeReport SSDRow ideal_ssd_speedup speculative_accept "
                               "speculative_benchmark speculative_generate speculative_report speculative_shootout",
})
