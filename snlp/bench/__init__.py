"""Benchmarks, measured side by side in one process after warm-up (medians): the SNLP forward, KV-cached decoding
(sequential, SNLP, self-speculative), per-op costs, the forward breakdown and the paper's speed suite."""

from snlp.runtime.lazy import lazy_exports

__all__ = ["ModelSpec", "build_model", "benchmark", "ForwardRow", "decode_benchmark", "DecodeRow", "op_benchmark",
           "OpRow", "SuiteConfig", "SuiteResult", "run_suite"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.bench.decode": "DecodeRow decode_benchmark",
    "snlp.bench.forward": "ForwardRow ModelSpec benchmark build_model",
    "snlp.bench.ops": "OpRow op_benchmark",
    "snlp.bench.suite": "SuiteConfig SuiteResult run_suite",
})
