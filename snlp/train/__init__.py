"""Training: TrainConfig -> fit -> TrainResult (AdamW + Muon, DDP, resumable, atomic saves, TrainHooks for
callers that pace or stop a run), the SNLP-aware regulariser and chat SFT."""

from snlp.train.config import TrainConfig, TrainResult
from snlp.train.hooks import TrainHooks
from snlp.train.sft import SFTConfig, sft
from snlp.train.trainer import fit

__all__ = ["TrainConfig", "TrainResult", "TrainHooks", "fit", "SFTConfig", "sft"]
