"""Benchmarks, measured side by side in one process after warm-up (medians): the SNLP forward, KV-cached decoding
(sequential, SNLP, self-speculative), per-op costs, the forward breakdown and the paper's speed suite."""

from snlp.bench.decode import DecodeRow, decode_benchmark
from snlp.bench.forward import ForwardRow, ModelSpec, benchmark, build_model
from snlp.bench.ops import OpRow, op_benchmark
from snlp.bench.suite import SuiteConfig, SuiteResult, run_suite

__all__ = ["ModelSpec", "build_model", "benchmark", "ForwardRow", "decode_benchmark", "DecodeRow", "op_benchmark",
           "OpRow", "SuiteConfig", "SuiteResult", "run_suite"]
