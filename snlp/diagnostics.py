"""Moved: early exit lives in `snlp.analysis` (with the paper's other diagnostics). This module
re-exports it so `from snlp.diagnostics import early_exit` keeps working."""

from .analysis import early_exit

__all__ = ["early_exit"]
