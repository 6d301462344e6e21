"""Layer parallelism across torchrun ranks (each rank owns a block of the plan's chunks) and the multi-device
cost model."""

from snlp.runtime.lazy import lazy_exports

__all__ = ["DistributedSNLP", "RankFailureError", "init_distributed"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.dist.layer_parallel": "DistributedSNLP RankFailureError init_distributed",
})
