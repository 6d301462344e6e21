"""The paper's evaluation: metrics, the evaluation protocol (EvalConfig -> evaluate -> EvalRecord) and its
validation data, EmbSim, multiple-choice tasks, presentation (tables, CSV, the frontier plot) and the analysis
suite (snlp.eval.analysis)."""

from snlp.eval.mc import MCConfig, MCResult
from snlp.eval.mc_eval import evaluate_mc
from snlp.eval.protocol import EvalConfig, EvalRecord, evaluate

__all__ = ["EvalConfig", "EvalRecord", "evaluate", "MCConfig", "MCResult", "evaluate_mc"]
