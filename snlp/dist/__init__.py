"""Layer parallelism across torchrun ranks (each rank owns a block of the plan's chunks) and the multi-device
cost model."""

from snlp.dist.layer_parallel import DistributedSNLP, RankFailureError, init_distributed

__all__ = ["DistributedSNLP", "RankFailureError", "init_distributed"]
